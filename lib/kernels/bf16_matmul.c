/* The dense bf16 GEMM (bf16_matmul.h): the output's columns cut into pieces over the pool, each
 * piece one call of the registry's MM kernel (both operands read in place), or of its NT or NN
 * kernel, over all M rows (the kernels walk their rows in cache-sized chunks themselves). */
#include "lib/kernels/bf16_matmul.h"

#include <string.h>

#include "lib/kernels/bf16_gemm.h"

/* MM's path where it comes no later in the table (the order of preference) than NT's or NN's
 * for these rows, else NULL. */
static const kt__kpath *mm_path(int trans_b, int64_t M)
{
    const kt__kpath *mm = kt__kpath_pick(KT__KP_MM_BF16, M);
    return mm <= kt__kpath_pick(trans_b ? KT__KP_NT_BF16 : KT__KP_NN_BF16, M) ? mm : NULL;
}

const kt__kpath *kt__bf16_matmul_path(int trans_b, int64_t M)
{
    const kt__kpath *mm = mm_path(trans_b, M);
    return mm != NULL ? mm : kt__kpath_pick(trans_b ? KT__KP_NT_BF16 : KT__KP_NN_BF16, M);
}

typedef struct mm_job {
    int trans_a, trans_b;
    int64_t M, N, K, lda, ldb, ldc, piece;
    const uint16_t *A, *B;
    float *C;
    const kt__kpath *mm; /* NULL: the NT or NN kernel, A as rows */
    char *work;          /* mm's, cut at the pieces' columns */
} mm_job;

static void mm_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const mm_job *j = ctx;
    const int64_t c0 = begin * j->piece, c1 = end * j->piece < j->N ? end * j->piece : j->N;
    if (c0 >= c1)
        return;
    if (j->mm != NULL) {
        char *work = j->mm->mm_work_bytes != NULL ? j->work + j->mm->mm_work_bytes(c0) : NULL;
        j->mm->mm_bf16(j->trans_a, j->trans_b, j->M, c0, c1, j->K, j->A, j->lda, j->B, j->ldb,
                       j->C, j->ldc, work);
    } else if (j->trans_b) /* y = x w^T, w = B [N, K] */
        kt__bf16_gemm_nt(j->M, c0, c1, j->K, j->A, j->lda, j->B, j->ldb, j->C, j->ldc, 0);
    else /* y = g w, g = A [M, K] reduced over K, w = B [K, N] */
        kt__bf16_gemm_nn(j->M, j->K, c0, c1, j->A, j->lda, j->B, j->ldb, j->C, j->ldc, 0);
}

typedef struct tr_job {
    const uint16_t *src; /* K x M, row stride ld */
    uint16_t *dst;       /* M x K */
    int64_t M, K, ld;
} tr_job;

/* rows [begin, end) of the transpose, in blocks of 32 x 32 so both sides stay in L1 */
static void tr_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const tr_job *t = ctx;
    for (int64_t k0 = 0; k0 < t->K; k0 += 32) {
        const int64_t k1 = t->K - k0 < 32 ? t->K : k0 + 32;
        for (int64_t m = begin; m < end; m++)
            for (int64_t k = k0; k < k1; k++)
                t->dst[m * t->K + k] = t->src[k * t->ld + m];
    }
}

/* MM's pieces: one a thread (the pool's partition is static), in whole panels of 32 columns. */
static int64_t mm_piece_columns(int64_t N, int threads)
{
    const int64_t piece = (N + threads - 1) / threads;
    return (piece + 31) / 32 * 32;
}

size_t kt__bf16_matmul_work_bytes(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K)
{
    const kt__kpath *mm = mm_path(trans_b, M);
    if (mm != NULL)
        return mm->mm_work_bytes != NULL ? mm->mm_work_bytes(N) : 0;
    return trans_a ? (size_t)(M * K) * sizeof(uint16_t) : 0;
}

/* Column pieces: whole register tiles (the NN kernels' 32 columns, a multiple of NT's 6 and of
 * the FMA tiles' widths), about four a thread so a slow thread on a shared machine holds up
 * less; products of few rows only stream B, and keep one long piece a thread (a narrow piece
 * of NN streams badly, bf16_gemm.h). */
static int64_t piece_columns(int64_t M, int64_t N, int threads)
{
    const int64_t per = M <= KT__BF16_NN_STREAM_MAX_M ? threads : 4 * (int64_t)threads;
    int64_t piece = (N + per - 1) / per;
    piece = (piece + 95) / 96 * 96;
    return piece < 96 ? 96 : piece;
}

void kt__bf16_matmul(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                     int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                     float *C, int64_t ldc, void *work)
{
    if (M <= 0 || N <= 0)
        return;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++)
            memset(C + m * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    const kt__kpath *mm = mm_path(trans_b, M);
    if (trans_a && mm == NULL) {
        tr_job t = {A, work, M, K, lda};
        kt_parallel_for(pool, M, 64, tr_part, &t);
        A = work;
        lda = K;
    }
    const int threads = kt_threadpool_size(pool);
    mm_job j = {trans_a, trans_b, M, N, K, lda, ldb, ldc,
                mm != NULL ? mm_piece_columns(N, threads) : piece_columns(M, N, threads),
                A, B, C, mm, work};
    kt_parallel_for(pool, (N + j.piece - 1) / j.piece, 1, mm_part, &j);
}
