/* kt-bench gemm's dense part: the bf16 matmul op against the register peak of its kernel path's
 * instruction, OpenBLAS's sgemm on the same values in f32, and the staged path it replaced. */
#ifndef KT_TOOLS_BENCH_GEMM_DENSE_H
#define KT_TOOLS_BENCH_GEMM_DENSE_H

#include <stdint.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"

/* m, n, k > 0: that one product; else the table (512^3, 1024^3, 2048^3 and the attention
 * projections). threads: the pool's (1 with single). baselines 0: the op alone (no OpenBLAS or
 * staged runs, their ratios null). Returns 0, or 1 when out of memory. */
int bench_gemm_dense(const bench_args *common, kt_threadpool *pool, int64_t m, int64_t n,
                     int64_t k, int single, int baselines);

/* --mixed (bench_gemm_mixed.c): the op on f32 x and a wdt (bf16 or f16) W, y = x W^T and the
 * gradient of x, against the same on W widened to f32, at m x n x k (0: 1024 x 2048 x 2048, a
 * LoRA fine-tune's projection over 1024 tokens). Returns 0, or 1 on failure. */
int bench_gemm_mixed(const bench_args *common, kt_threadpool *pool, int64_t m, int64_t n,
                     int64_t k, kt_dtype wdt, int single);

#endif
