/* f32 GEMMs (see f32_gemm.h): the scalar references, and the entry points, which take their
 * path from the registry (registry.h); the kernels are fma_gemm.c's and fma_unpacked.c's. */
#include <math.h>
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/registry.h"

/* Where the layer's own kernels run its f32 products: wherever the registry has a path other
 * than the references for them (x86-64 with AVX-512, unless KT_CPU=blas). */
int kt__f32_gemm_tiled(void)
{
    return kt__kpath_pick(KT__KP_TN_F32, 0) != &kt__kpaths[kt__kpath_count - 1];
}

const char *kt__f32_gemm_path(const char *kind, int64_t M)
{
    const kt__kprod prod = kind[0] == 'n' && kind[1] == 't'   ? KT__KP_NT_F32
                           : kind[0] == 'n' && kind[1] == 'n' ? KT__KP_NN_F32
                                                              : KT__KP_TN_F32;
    return kt__kpath_sums_name(prod, M);
}

/* ---- the references --------------------------------------------------------------------- */

/* s + sum a[i * sa] b[i * sb] over i < n, one fmaf per step in index order. (Built for
 * baseline x86-64, which has no FMA instruction, the compiler cannot contract the separate
 * multiply and add of TN's finish into one.) */
static float dot_ref(float s, const float *a, int64_t sa, const float *b, int64_t sb, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        s = fmaf(a[i * sa], b[i * sb], s);
    return s;
}

void kt__f32_gemm_nt_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++)
            y[m * ldy + n] =
                dot_ref(accumulate ? y[m * ldy + n] : 0.0f, x + m * ldx, 1, w + n * ldw, 1, K);
}

void kt__f32_gemm_nn_ref(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = k0; k < k1; k++)
            y[m * ldy + k] =
                dot_ref(accumulate ? y[m * ldy + k] : 0.0f, g + m * ldg, 1, w + k, ldw, N);
}

void kt__f32_gemm_tn_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                         const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                         int accumulate)
{
    for (int64_t n = n0; n < n1; n++)
        for (int64_t k = 0; k < K; k++) {
            const float v = scale * dot_ref(0.0f, g + n, ldg, x + k, ldx, M);
            dw[n * lddw + k] = accumulate ? dw[n * lddw + k] + v : v;
        }
}

/* ---- dispatch: the path from the registry, once per call ------------------------------- */

void kt__f32_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || n1 <= n0)
        return;
    kt__kpath_pick(KT__KP_NT_F32, M)->nt_f32(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

void kt__f32_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || k1 <= k0)
        return;
    kt__kpath_pick(KT__KP_NN_F32, M)->nn_f32(M, N, k0, k1, g, w, NULL, NULL, ldg, ldw, y, ldy,
                                             accumulate);
}

void kt__f32_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                      const float *w0, const float *g1, const float *w1, int64_t ldg, int64_t ldw,
                      float *y, int64_t ldy)
{
    if (M <= 0 || k1 <= k0)
        return;
    kt__kpath_pick(KT__KP_NN2_F32, M)->nn_f32(M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);
}

size_t kt__f32_gemm_tn_work_bytes(int64_t M)
{
    return kt__kpath_tn_work_bytes(KT__KP_TN_F32, M);
}

void kt__f32_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                     const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate, void *work)
{
    if (n1 <= n0 || K <= 0)
        return;
    kt__kpath_pick(KT__KP_TN_F32, M)->tn_f32(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale,
                                             accumulate, work);
}
