/* Machine limits measured by kt-bench in the same run as the figures judged against them. */
#ifndef KT_TOOLS_LIMITS_H
#define KT_TOOLS_LIMITS_H

#include <stddef.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "lib/kernels/registry.h"

/* A buffer of `bytes` allocated as the layer's weights are (huge pages where large), read
 * whole in parallel passes: the memory read bandwidth as a plain loop gets it. open returns
 * NULL when the buffer cannot be allocated; pass returns one pass's GB/s. */
typedef struct bench_read_probe bench_read_probe;
bench_read_probe *bench_read_probe_open(size_t bytes);
double bench_read_probe_pass(bench_read_probe *p, kt_threadpool *pool);
void bench_read_probe_close(bench_read_probe *p);
/* Register peak (GFLOP/s) of the instruction the bf16 GEMMs of large products run on (the
 * registry's descriptor for them, kernels/registry.h: vdpbf16ps, or vfmadd231ps where they widen
 * bf16 to f32, at the path's width; bench_bf16_peak_name: its name) on `threads` threads (the
 * pool's; NULL pool: the caller's), the best of `repeats` runs after a warm-up; 0 where it cannot
 * run. */
double bench_bf16_peak_gflops(kt_threadpool *pool, int threads, int repeats);
const char *bench_bf16_peak_name(void);
/* The vfmadd231ps register peak of the f32 MoE kernels' path (at its width), 0 where they are
 * not the layer's own (scalar, or KT_CPU=blas). */
double bench_fma_peak_gflops(kt_threadpool *pool, int threads, int repeats);
/* The widest FMA this CPU runs (512: AVX-512, 256: AVX2 + FMA, 0: neither): the width of the
 * kernels that are no registry path (the attention blocks, attn_block.h). */
int bench_fma_bits(void);
/* The same for the instruction a kernel path multiplies with at its width (kt__kpath's insn and
 * bits; the name is kt__kinsn_names[insn]): 0 for the scalar path, for AMX (no tile loop yet)
 * and where the CPU lacks the instruction at that width. */
double bench_path_peak_gflops(const kt__kpath *p, kt_threadpool *pool, int threads, int repeats);
double bench_insn_peak_gflops(kt__kinsn insn, int bits, kt_threadpool *pool, int threads,
                              int repeats);

#endif
