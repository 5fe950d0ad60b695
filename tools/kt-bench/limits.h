/* Machine limits measured by kt-bench in the same run as the figures judged against them. */
#ifndef KT_TOOLS_LIMITS_H
#define KT_TOOLS_LIMITS_H

#include <stddef.h>

#include <kt/kt.h>

#include "bench.h"

/* Best of several parallel read passes over `bytes` of memory (GB/s). */
double bench_read_bandwidth_gbs(kt_threadpool *pool, size_t bytes);
/* Register peak of vdpbf16ps (GFLOP/s) on `threads` threads (the pool's; NULL pool: the
 * caller's), median of `repeats` runs after a warm-up; 0 without AVX-512 BF16. */
double bench_bf16_peak_gflops(kt_threadpool *pool, int threads, int repeats);

#endif
