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

/* ---- numpy-style broadcasting ------------------------------------------------------------ */

/* b's dim aligned with a's dim d (counted from the end: 0 is the last), 1 beyond b's dims */
static int64_t b_dim_from_end(const kt_tensor *b, int d)
{
    return d < b->ndim ? b->shape[b->ndim - 1 - d] : 1;
}

int kt__bcast_ok(const kt_tensor *a, const kt_tensor *b)
{
    for (int d = 0; d < b->ndim; d++) {
        const int64_t bd = b_dim_from_end(b, d);
        if (d >= a->ndim ? bd != 1 : bd != 1 && bd != a->shape[a->ndim - 1 - d])
            return 0;
    }
    return 1;
}

int kt__bcast_flat(const kt_tensor *a, const kt_tensor *b)
{
    int lead = 0; /* b's leading 1s */
    while (lead < b->ndim && b->shape[lead] == 1)
        lead++;
    if (b->ndim - lead > a->ndim)
        return 0;
    for (int d = 0; d < b->ndim - lead; d++)
        if (b_dim_from_end(b, d) != a->shape[a->ndim - 1 - d])
            return 0;
    return 1;
}

/* a's shape and b's, both padded to KT_MAX_DIMS with 1s in front, and b's element strides
 * along a's dims (0 where b is 1, so a broadcast dim never moves in b) */
typedef struct bcast_shape {
    int64_t n[KT_MAX_DIMS], bn[KT_MAX_DIMS], bs[KT_MAX_DIMS];
} bcast_shape;

static bcast_shape bcast_of(const kt_tensor *a, const kt_tensor *b)
{
    bcast_shape s;
    int64_t stride = 1;
    for (int d = KT_MAX_DIMS - 1; d >= 0; d--) {
        const int from_end = KT_MAX_DIMS - 1 - d;
        s.n[d] = from_end < a->ndim ? a->shape[a->ndim - 1 - from_end] : 1;
        s.bn[d] = b_dim_from_end(b, from_end);
        s.bs[d] = s.bn[d] == 1 ? 0 : stride;
        stride *= s.bn[d];
    }
    return s;
}

typedef struct bcast_job {
    bcast_shape s;
    kt_tensor *o;
    const kt_tensor *a, *b;
    kt__map2_fn fn;
    const kt_op_attrs *attrs;
} bcast_job;

/* rows (the last dim) of a: b's row is contiguous where b has a's last dim, else one value */
static void map2_bcast_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const bcast_job *j = ctx;
    const bcast_shape *s = &j->s;
    const int64_t len = s->n[3];
    float abuf[KT__CHUNK], bbuf[KT__CHUNK], obuf[KT__CHUNK], one;
    for (int64_t r = begin; r < end; r++) {
        const int64_t i2 = r % s->n[2], i1 = r / s->n[2] % s->n[1], i0 = r / s->n[2] / s->n[1];
        const int64_t boff = i0 * s->bs[0] + i1 * s->bs[1] + i2 * s->bs[2];
        const float bv = s->bs[3] == 0 ? *kt__load_f32(j->b, boff, 1, &one) : 0.0f;
        for (int64_t c = 0; c < len; c += KT__CHUNK) {
            const int64_t n = len - c < KT__CHUNK ? len - c : KT__CHUNK;
            const float *a = kt__load_f32(j->a, r * len + c, n, abuf);
            const float *b;
            if (s->bs[3] != 0) {
                b = kt__load_f32(j->b, boff + c, n, bbuf);
            } else {
                for (int64_t k = 0; k < n; k++)
                    bbuf[k] = bv;
                b = bbuf;
            }
            float *o = kt__store_ptr(j->o, r * len + c, obuf);
            j->fn(o, a, b, n, j->attrs);
            kt__store_commit(j->o, r * len + c, n, obuf);
        }
    }
}

void kt__map2_bcast(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, const kt_tensor *b,
                    kt__map2_fn fn, const kt_op_attrs *attrs)
{
    bcast_job j = {.s = bcast_of(a, b), .o = o, .a = a, .b = b, .fn = fn, .attrs = attrs};
    const int64_t rows = j.s.n[0] * j.s.n[1] * j.s.n[2];
    if (rows == 0 || j.s.n[3] == 0)
        return;
    kt_parallel_for(pool, rows, kt__rows_grain(j.s.n[3]), map2_bcast_rows, &j);
}

/* Work item w: row w / pieces of db (its last dim) and, where db has g's last dim, the
 * KT__CHUNK columns w % pieces of it; else (db's last dim is 1) its one element, summed over
 * g's whole rows. The rows of g the item gathers are walked in increasing order. */
typedef struct reduce_bcast_job {
    bcast_shape s; /* g's shape (n) and db's (bn) */
    kt_tensor *db;
    const kt_tensor *g, *a;
    int64_t pieces;
    kt__map2_fn fn;
    const kt_op_attrs *attrs;
} reduce_bcast_job;

static void reduce_bcast_items(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const reduce_bcast_job *j = ctx;
    const bcast_shape *s = &j->s;
    const int64_t len = s->n[3];
    const int along = s->bn[3] == len; /* db's row lines up with g's */
    float gbuf[KT__CHUNK], abuf[KT__CHUNK], pbuf[KT__CHUNK], acc[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t w = begin; w < end; w++) {
        const int64_t brow = w / j->pieces;
        const int64_t c0 = along ? w % j->pieces * KT__CHUNK : 0;
        const int64_t width = along ? (s->bn[3] - c0 < KT__CHUNK ? s->bn[3] - c0 : KT__CHUNK) : 1;
        const int64_t j2 = brow % s->bn[2], j1 = brow / s->bn[2] % s->bn[1];
        const int64_t j0 = brow / s->bn[2] / s->bn[1];
        const int64_t lo[3] = {s->bn[0] == 1 ? 0 : j0, s->bn[1] == 1 ? 0 : j1, s->bn[2] == 1 ? 0 : j2};
        const int64_t hi[3] = {s->bn[0] == 1 ? s->n[0] : j0 + 1, s->bn[1] == 1 ? s->n[1] : j1 + 1,
                               s->bn[2] == 1 ? s->n[2] : j2 + 1};
        for (int64_t k = 0; k < width; k++)
            acc[k] = 0.0f;
        for (int64_t i0 = lo[0]; i0 < hi[0]; i0++)
            for (int64_t i1 = lo[1]; i1 < hi[1]; i1++)
                for (int64_t i2 = lo[2]; i2 < hi[2]; i2++) {
                    const int64_t row = (i0 * s->n[1] + i1) * s->n[2] + i2;
                    if (along) {
                        const int64_t off = row * len + c0;
                        const float *g = kt__load_f32(j->g, off, width, gbuf);
                        const float *a = j->a ? kt__load_f32(j->a, off, width, abuf) : NULL;
                        j->fn(pbuf, g, a, width, j->attrs);
                        for (int64_t k = 0; k < width; k++)
                            acc[k] += pbuf[k];
                        continue;
                    }
                    for (int64_t c = 0; c < len; c += KT__CHUNK) {
                        const int64_t n = len - c < KT__CHUNK ? len - c : KT__CHUNK;
                        const float *g = kt__load_f32(j->g, row * len + c, n, gbuf);
                        const float *a = j->a ? kt__load_f32(j->a, row * len + c, n, abuf) : NULL;
                        j->fn(pbuf, g, a, n, j->attrs);
                        for (int64_t k = 0; k < n; k++)
                            acc[0] += pbuf[k];
                    }
                }
        const int64_t at = brow * s->bn[3] + c0;
        float *o = kt__store_ptr(j->db, at, obuf);
        for (int64_t k = 0; k < width; k++)
            o[k] = acc[k];
        kt__store_commit(j->db, at, width, obuf);
    }
}

void kt__reduce_bcast(kt_threadpool *pool, kt_tensor *db, const kt_tensor *g,
                      const kt_tensor *a, kt__map2_fn fn, const kt_op_attrs *attrs)
{
    const int64_t nb = kt_tensor_numel(db);
    if (nb == 0)
        return;
    reduce_bcast_job j = {.s = bcast_of(g, db), .db = db, .g = g, .a = a, .fn = fn, .attrs = attrs};
    const int along = j.s.bn[3] == j.s.n[3];
    j.pieces = along ? (j.s.bn[3] + KT__CHUNK - 1) / KT__CHUNK : 1;
    const int64_t items = nb / j.s.bn[3] * j.pieces;
    /* the elements of g one item gathers, to size the grain */
    const int64_t per = kt_tensor_numel(g) / nb * (along ? KT__CHUNK : 1);
    kt_parallel_for(pool, items, per > 0 && per < KT__GRAIN_ELEMS ? KT__GRAIN_ELEMS / per : 1,
                    reduce_bcast_items, &j);
}
