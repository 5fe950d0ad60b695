/* kt__amx_selftest (see amx_gemm.h): the AMX kernels against the scalar reference on one small
 * problem before they are trusted. The NN kernel has the NT signature with (N, k0, k1) in
 * the places of (n0, n1, K). */
#include <math.h>
#include <string.h>

#include "lib/core/mix.h"
#include "kt/tensor.h"
#include "lib/kernels/amx_gemm.h"
#include "lib/kernels/bf16_gemm.h"

/* M rows: two row tiles and a ragged third; N, K: not multiples of 16 or 32 */
enum { ST_M = 37, ST_N = 45, ST_K = 70 };

static void st_fill(uint16_t *v, int n, uint64_t *s)
{
    for (int i = 0; i < n; i++)
        v[i] = kt_f32_to_bf16_1((float)((double)(kt__splitmix64((*s)++) % 2001) / 1000.0 - 1.0));
}

/* 1 when every element agrees within 1e-3 of the largest reference magnitude (an order of
 * f32 sums of 70 terms differs by far less; a wrong tile, layout or edge by far more). */
static int st_close(const float *got, const float *want, int n)
{
    float big = 1.0f;
    for (int i = 0; i < n; i++)
        big = fabsf(want[i]) > big ? fabsf(want[i]) : big;
    for (int i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-3f * big))
            return 0;
    return 1;
}

int kt__amx_selftest(kt__gemm_nt_fn nt, kt__gemm_nt_fn nn, kt__gemm_tn_fn tn)
{
    static uint16_t a[ST_M * ST_K], b[ST_N * ST_K], g[ST_M * ST_N];
    static float got[ST_M * ST_N > ST_N * ST_K ? ST_M * ST_N : ST_N * ST_K];
    static float want[sizeof got / sizeof got[0]];
    uint64_t seed = 0x6b742d616d78ull;
    st_fill(a, ST_M * ST_K, &seed);
    st_fill(b, ST_N * ST_K, &seed);
    st_fill(g, ST_M * ST_N, &seed);
    for (int acc = 0; acc < 2; acc++) {
        /* NT: y[M, N] = a[M, K] b[N, K]^T (+ y); overwriting must not read y's 7s */
        for (int i = 0; i < ST_M * ST_N; i++)
            got[i] = want[i] = acc ? 0.5f : 7.0f;
        nt(ST_M, 0, ST_N, ST_K, a, ST_K, b, ST_K, got, ST_N, acc);
        kt__bf16_gemm_nt_ref(ST_M, 0, ST_N, ST_K, a, ST_K, b, ST_K, want, ST_N, acc);
        if (!st_close(got, want, ST_M * ST_N))
            return 0;
        /* NN: y[M, K] = g[M, N] b[N, K] (+ y) */
        for (int i = 0; i < ST_M * ST_K; i++)
            got[i] = want[i] = acc ? 0.5f : 7.0f;
        nn(ST_M, ST_N, 0, ST_K, g, ST_N, b, ST_K, got, ST_K, acc);
        kt__bf16_gemm_nn_ref(ST_M, ST_N, 0, ST_K, g, ST_N, b, ST_K, want, ST_K, acc);
        if (!st_close(got, want, ST_M * ST_K))
            return 0;
        /* TN: dw[N, K] = 0.75 g[M, N]^T a[M, K] (+ dw) */
        for (int i = 0; i < ST_N * ST_K; i++)
            got[i] = want[i] = acc ? 0.25f : 7.0f;
        tn(ST_M, 0, ST_N, ST_K, g, ST_N, a, ST_K, got, ST_K, 0.75f, acc);
        kt__bf16_gemm_tn_ref(ST_M, 0, ST_N, ST_K, g, ST_N, a, ST_K, want, ST_K, 0.75f, acc);
        if (!st_close(got, want, ST_N * ST_K))
            return 0;
    }
    return 1;
}
