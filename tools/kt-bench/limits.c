/* This machine's limits, measured in the same run as the thing judged against them:
 * the memory read bandwidth and the register peak of vdpbf16ps. */
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "limits.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef struct read_job {
    const float *data;
    double *partial; /* one per thread */
} read_job;

__attribute__((target("avx512f"))) static void read_range_avx512(void *ctx, int64_t b,
                                                                  int64_t e, int thread)
{
    read_job *j = ctx;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = b;
    for (; i + 64 <= e; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(j->data + i));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(j->data + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(j->data + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(j->data + i + 48));
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < e; i++)
        s += j->data[i];
    j->partial[thread] += s;
}

static void read_range(void *ctx, int64_t b, int64_t e, int thread)
{
    read_job *j = ctx;
    float s = 0.0f;
    for (int64_t i = b; i < e; i++)
        s += j->data[i];
    j->partial[thread] += s;
}

double bench_read_bandwidth_gbs(kt_threadpool *pool, size_t bytes)
{
    int64_t n = (int64_t)(bytes / sizeof(float));
    float *data = NULL;
    if (posix_memalign((void **)&data, 64, (size_t)n * sizeof(float)) != 0)
        return 0.0;
    for (int64_t i = 0; i < n; i++)
        data[i] = (float)(i & 7);
    double partial[1024] = {0};
    read_job j = {data, partial};
    kt_range_fn fn = kt_cpu_get_features()->avx512f ? read_range_avx512 : read_range;
    double best = 0.0;
    for (int rep = 0; rep < 6; rep++) {
        double t0 = bench_now_s();
        kt_parallel_for(pool, n, 1 << 16, fn, &j);
        double dt = bench_now_s() - t0;
        if (rep > 0 && dt > 0 && (double)bytes / dt > best) /* first pass warms the pages */
            best = (double)bytes / dt;
    }
    free(data);
    return best * 1e-9;
}

#define PEAK_ITERS 200000

__attribute__((target("avx512f,avx512bf16"))) static void peak_range(void *ctx, int64_t b,
                                                                      int64_t e, int thread)
{
    (void)thread;
    double *flops = ctx;
    __m512 acc[12];
    for (int k = 0; k < 12; k++)
        acc[k] = _mm512_set1_ps((float)k);
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int64_t r = b; r < e; r++)
        for (int it = 0; it < PEAK_ITERS; it++)
            for (int k = 0; k < 12; k++)
                acc[k] = _mm512_dpbf16_ps(acc[k], a, c);
    __m512 s = acc[0];
    for (int k = 1; k < 12; k++)
        s = _mm512_add_ps(s, acc[k]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    flops[0] = 0; /* written by the caller */
}

double bench_bf16_peak_gflops(kt_threadpool *pool)
{
    if (!kt_cpu_get_features()->avx512_bf16)
        return 0.0;
    int threads = kt_threadpool_size(pool);
    double unused = 0, best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = bench_now_s();
        kt_parallel_for(pool, threads, 1, peak_range, &unused);
        double dt = bench_now_s() - t0;
        /* each vdpbf16ps on zmm: 16 lanes x 2 products x 2 flops */
        double flops = (double)threads * PEAK_ITERS * 12.0 * 64.0;
        if (flops / dt > best)
            best = flops / dt;
    }
    return best * 1e-9;
}
