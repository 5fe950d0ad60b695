/* Element-wise drivers over the thread pool.
 *
 * Work is cut by element index into fixed contiguous parts (static partition), and each part
 * is processed in KT__CHUNK pieces through f32 buffers, so one f32 function serves every
 * float dtype. Element-wise results do not depend on the thread count at all; the row
 * reduction splits columns, never rows, so its summation order is fixed too. */
#include "lib/ops/map.h"
#include "lib/ops/op_util.h"


typedef struct map_job {
    kt_tensor *o;
    const kt_tensor *a, *b;
    int64_t inner; /* numel(b) */
    kt__map1_fn f1;
    kt__map2_fn f2;
    const kt_op_attrs *attrs;
} map_job;

static void map1_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const map_job *j = ctx;
    float abuf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t i = begin; i < end; i += KT__CHUNK) {
        int64_t n = end - i < KT__CHUNK ? end - i : KT__CHUNK;
        const float *a = kt__load_f32(j->a, i, n, abuf);
        float *o = kt__store_ptr(j->o, i, obuf);
        j->f1(o, a, n, j->attrs);
        kt__store_commit(j->o, i, n, obuf);
    }
}

void kt__map1(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, kt__map1_fn fn,
              const kt_op_attrs *attrs)
{
    map_job j = {.o = o, .a = a, .f1 = fn, .attrs = attrs};
    kt_parallel_for(pool, kt_tensor_numel(a), KT__GRAIN_ELEMS, map1_range, &j);
}

static void map2_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const map_job *j = ctx;
    float abuf[KT__CHUNK], bbuf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t i = begin; i < end;) {
        int64_t bi = i % j->inner;
        int64_t n = end - i;
        if (n > KT__CHUNK)
            n = KT__CHUNK;
        if (n > j->inner - bi)
            n = j->inner - bi; /* a piece never wraps around b */
        const float *a = kt__load_f32(j->a, i, n, abuf);
        const float *b = kt__load_f32(j->b, bi, n, bbuf);
        float *o = kt__store_ptr(j->o, i, obuf);
        j->f2(o, a, b, n, j->attrs);
        kt__store_commit(j->o, i, n, obuf);
        i += n;
    }
}

void kt__map2(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, const kt_tensor *b,
              kt__map2_fn fn, const kt_op_attrs *attrs)
{
    int64_t inner = kt_tensor_numel(b);
    if (inner == 0)
        return;
    map_job j = {.o = o, .a = a, .b = b, .inner = inner, .f2 = fn, .attrs = attrs};
    kt_parallel_for(pool, kt_tensor_numel(a), KT__GRAIN_ELEMS, map2_range, &j);
}

typedef struct reduce_job {
    kt_tensor *db;
    const kt_tensor *g, *a;
    int64_t inner, rows;
    kt__map2_fn fn;
    const kt_op_attrs *attrs;
} reduce_job;

static void reduce_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const reduce_job *j = ctx;
    float gbuf[KT__CHUNK], abuf[KT__CHUNK], pbuf[KT__CHUNK], acc[KT__CHUNK];
    for (int64_t c = begin; c < end; c += KT__CHUNK) {
        int64_t n = end - c < KT__CHUNK ? end - c : KT__CHUNK;
        for (int64_t k = 0; k < n; k++)
            acc[k] = 0.0f;
        for (int64_t r = 0; r < j->rows; r++) {
            int64_t off = r * j->inner + c;
            const float *g = kt__load_f32(j->g, off, n, gbuf);
            const float *a = j->a ? kt__load_f32(j->a, off, n, abuf) : NULL;
            j->fn(pbuf, g, a, n, j->attrs);
            for (int64_t k = 0; k < n; k++)
                acc[k] += pbuf[k];
        }
        float obuf[KT__CHUNK];
        float *o = kt__store_ptr(j->db, c, obuf);
        for (int64_t k = 0; k < n; k++)
            o[k] = acc[k];
        kt__store_commit(j->db, c, n, obuf);
    }
}

void kt__reduce_rows(kt_threadpool *pool, kt_tensor *db, const kt_tensor *g,
                     const kt_tensor *a, kt__map2_fn fn, const kt_op_attrs *attrs)
{
    int64_t inner = kt_tensor_numel(db);
    if (inner == 0)
        return;
    reduce_job j = {.db = db, .g = g, .a = a, .inner = inner,
                    .rows = kt_tensor_numel(g) / inner, .fn = fn, .attrs = attrs};
    kt_parallel_for(pool, inner, kt__cols_grain(j.rows), reduce_range, &j);
}
