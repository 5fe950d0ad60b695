/* The dense matmul's mixed product (mixed_matmul.h): the registry's MM_MIXED kernel over pieces
 * of the output's columns, one piece a thread, or the portable f32 kernel widening as it packs. */
#include "lib/kernels/mixed_matmul.h"

#include "lib/kernels/registry.h"
#include "lib/kernels/sgemm.h"

/* The registry's path, or NULL where it has only the scalar reference (too slow to run a
 * model on; the tests compare against it). */
static const kt__kpath *mixed_path(int64_t M)
{
    const kt__kpath *p = kt__kpath_pick(KT__KP_MM_MIXED, M);
    return p == &kt__kpaths[kt__kpath_count - 1] ? NULL : p;
}

const char *kt__mixed_matmul_path(int64_t M)
{
    const kt__kpath *p = mixed_path(M);
    return p != NULL ? p->name : "portable_sgemm";
}

static kt__kelem elem_of(kt_dtype dt)
{
    return dt == KT_F32 ? KT__KE_F32 : dt == KT_BF16 ? KT__KE_BF16 : KT__KE_F16;
}

/* A piece below this many multiply-adds is not worth waking a thread for. */
#define MIXED_MIN_PIECE_MACS ((int64_t)1 << 18)

/* Pieces of whole 32-column panels, one a thread (the pool's partition is static), none
 * smaller than MIXED_MIN_PIECE_MACS (the split never changes a sum). */
static int64_t piece_columns(int64_t M, int64_t N, int64_t K, int threads)
{
    int64_t piece = (N + threads - 1) / threads;
    const int64_t macs = M * (K > 0 ? K : 1);
    const int64_t least = MIXED_MIN_PIECE_MACS / (macs > 0 ? macs : 1);
    piece = piece < least ? least : piece;
    return (piece + 31) / 32 * 32;
}

size_t kt__mixed_matmul_work_bytes(int64_t M, int64_t N)
{
    const kt__kpath *p = mixed_path(M);
    return p != NULL && p->mm_work_bytes != NULL ? p->mm_work_bytes(N) : 0;
}

typedef struct mixed_job {
    const kt__kpath *path;
    kt__kelem ea, eb;
    int trans_a, trans_b;
    int64_t M, N, K, lda, ldb, ldc, piece;
    const void *A, *B;
    float *C;
    char *work; /* the path's, cut at the pieces' columns */
} mixed_job;

static void mixed_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const mixed_job *j = ctx;
    const int64_t c0 = begin * j->piece, c1 = end * j->piece < j->N ? end * j->piece : j->N;
    if (c0 >= c1)
        return;
    char *work = j->path->mm_work_bytes != NULL ? j->work + j->path->mm_work_bytes(c0) : NULL;
    j->path->mm_mixed(j->ea, j->eb, j->trans_a, j->trans_b, j->M, c0, c1, j->K, j->A, j->lda, j->B,
                      j->ldb, j->C, j->ldc, work);
}

kt_status kt__mixed_matmul(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                           int64_t K, const void *A, kt_dtype a_dtype, int64_t lda, const void *B,
                           kt_dtype b_dtype, int64_t ldb, float *C, int64_t ldc, void *work)
{
    const kt__kpath *path = mixed_path(M);
    if (path == NULL)
        return kt__sgemm_mixed(pool, trans_a, trans_b, M, N, K, A, a_dtype, lda, B, b_dtype, ldb,
                               C, ldc);
    if (M <= 0 || N <= 0)
        return KT_OK;
    mixed_job j = {path, elem_of(a_dtype), elem_of(b_dtype), trans_a, trans_b, M, N, K, lda, ldb,
                   ldc, piece_columns(M, N, K, kt_threadpool_size(pool)), A, B, C, work};
    kt_parallel_for(pool, (N + j.piece - 1) / j.piece, 1, mixed_part, &j);
    return KT_OK;
}
