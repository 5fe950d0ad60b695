/* See onednn_peer.h. */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include "tools/kt-bench/onednn_peer.h"

#include <dlfcn.h>
#include <stdlib.h>

typedef int (*gemm_bf16_fn)(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                            const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                            float beta, float *C, int64_t ldc);
typedef void (*omp_threads_fn)(int n);

static int tried;
static gemm_bf16_fn gemm_bf16;
static omp_threads_fn omp_threads;

int onednn_peer_available(void)
{
    if (!tried) {
        tried = 1;
        setenv("OMP_WAIT_POLICY", "passive", 0);
        void *h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_GLOBAL);
        if (h != NULL) {
            *(void **)&gemm_bf16 = dlsym(h, "dnnl_gemm_bf16bf16f32");
            *(void **)&omp_threads = dlsym(RTLD_DEFAULT, "omp_set_num_threads");
        }
    }
    return gemm_bf16 != NULL;
}

int onednn_peer_gemm(int kind, int64_t M, int64_t N, int64_t K, const uint16_t *a, int64_t lda,
                     const uint16_t *b, int64_t ldb, float *c, int threads)
{
    if (!onednn_peer_available())
        return -1;
    if (omp_threads != NULL)
        omp_threads(threads);
    switch (kind) {
    case 0: /* y = x w^T */
        return gemm_bf16('N', 'T', M, N, K, 1.0f, a, lda, b, ldb, 0.0f, c, N);
    case 1: /* y = g w */
        return gemm_bf16('N', 'N', M, K, N, 1.0f, a, lda, b, ldb, 0.0f, c, K);
    default: /* dw += g^T x */
        return gemm_bf16('T', 'N', N, K, M, 1.0f, a, lda, b, ldb, 1.0f, c, K);
    }
}
