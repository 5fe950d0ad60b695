/* See attn_block.h. */
#include <math.h>
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/attn_block.h"
#include "lib/kernels/lane_mask.h"

/* ---- plain C ---------------------------------------------------------------------------- */

static void gemm_plain(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                       int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                       int accumulate)
{
    for (int64_t m = 0; m < M; m++) {
        float *c = C + m * ldc;
        if (!accumulate)
            memset(c, 0, (size_t)N * sizeof *c);
        /* row by row of B: each c[n] still sums its k in order */
        for (int64_t k = 0; k < K; k++) {
            const float a = A[m * sam + k * sak];
            const float *b = B + k * ldb;
            for (int64_t n = 0; n < N; n++)
                c[n] += a * b[n];
        }
    }
}

static void softcap_plain(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
    const float inv = 1.0f / cap;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * ld + c] = cap * tanhf(x[r * ld + c] * inv);
}

static void online_plain(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                         float *alpha)
{
    for (int64_t c = 0; c < cols; c++) {
        float mx = m[c];
        for (int64_t r = 0; r < rows; r++)
            mx = s[r * ld + c] > mx ? s[r * ld + c] : mx;
        const float use = mx == -INFINITY ? 0.0f : mx; /* all masked: exp(-inf) = 0 */
        float sum = 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            const float p = expf(s[r * ld + c] - use);
            s[r * ld + c] = p;
            sum += p;
        }
        alpha[c] = expf(m[c] - use);
        l[c] = l[c] * alpha[c] + sum;
        m[c] = mx;
    }
}

static void probs_grad_plain(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                             int64_t ldp, const float *lse, const float *di, int per_col,
                             float cap)
{
    const float inv = cap > 0.0f ? 1.0f / cap : 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = per_col ? c : r;
            const float x = s[r * lds + c];
            const float p = expf(x - lse[i]);
            float ds = p * (dp[r * ldp + c] - di[i]);
            if (cap > 0.0f) {
                const float y = (x > -cap ? x : -cap) * inv; /* masked: factor 0, not -inf */
                ds *= 1.0f - y * y;
            }
            s[r * lds + c] = p;
            dp[r * ldp + c] = ds;
        }
}

/* ---- dispatch ------------------------------------------------------------------------------ */

void kt__attn_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam, int64_t sak,
                   const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate)
{
    if (M <= 0 || N <= 0)
        return;
    gemm_plain(M, N, K, A, sam, sak, B, ldb, C, ldc, accumulate);
}

void kt__attn_softcap(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
    softcap_plain(rows, cols, x, ld, cap);
}

void kt__attn_online_cols(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                          float *alpha)
{
    online_plain(rows, cols, s, ld, m, l, alpha);
}

void kt__attn_scale_cols(int64_t rows, int64_t cols, float *x, int64_t ld, const float *f)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * ld + c] *= f[c];
}

void kt__attn_probs_grad(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                         int64_t ldp, const float *lse, const float *di, int per_col, float cap)
{
    probs_grad_plain(rows, cols, s, lds, dp, ldp, lse, di, per_col, cap);
}
