/* Machine limits measured by kt-bench in the same run as the figures judged against them. */
#ifndef KT_TOOLS_LIMITS_H
#define KT_TOOLS_LIMITS_H

#include <stddef.h>

#include <kt/kt.h>

#include "bench.h"

/* Best of several parallel read passes over `bytes` of memory (GB/s). */
double bench_read_bandwidth_gbs(kt_threadpool *pool, size_t bytes);
/* Register peak of vdpbf16ps over the pool's threads (GFLOP/s); 0 without AVX-512 BF16. */
double bench_bf16_peak_gflops(kt_threadpool *pool);

#endif
