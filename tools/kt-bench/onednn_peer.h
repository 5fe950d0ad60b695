/* oneDNN's bf16 GEMM (dnnl_gemm_bf16bf16f32) as kt-bench gemm's library peer.
 *
 * Loaded at run time with dlopen from libdnnl.so.2 (Debian's libdnnl2, which python3-torch
 * pulls in), so kt-bench needs no oneDNN headers to build and runs without it (the peer is
 * then reported as absent). oneDNN threads with OpenMP; OMP_WAIT_POLICY=passive is set before
 * it loads (unless already set) so that its threads sleep between calls instead of spinning
 * against libkt's pool on a small machine: a wake-up per call, a few percent at these sizes. */
#ifndef KT_TOOLS_ONEDNN_PEER_H
#define KT_TOOLS_ONEDNN_PEER_H

#include <stdint.h>

/* 1 when the library and its GEMM were found (loads them on the first call). */
int onednn_peer_available(void);
/* The same products as the kernels of lib/kernels/bf16_gemm.h, whole (no block), row-major, on
 * `threads` OpenMP threads (a's rows lda apart, b's ldb):
 *   kind 0 (nt): c[M,N] = a[M,K] b[N,K]^T      kind 1 (nn): c[M,K] = a[M,N] b[N,K]
 *   kind 2 (tn): c[N,K] += a[M,N]^T b[M,K]
 * Returns 0 on success. */
int onednn_peer_gemm(int kind, int64_t M, int64_t N, int64_t K, const uint16_t *a, int64_t lda,
                     const uint16_t *b, int64_t ldb, float *c, int threads);

#endif
