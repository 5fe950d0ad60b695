/* This machine's limits, measured in the same run as the thing judged against them:
 * the memory read bandwidth and the register peaks of vdpbf16ps and of vfmadd231ps on zmm and
 * on ymm (the width a kernel path multiplies at: its descriptor's bits). */
#include <stdlib.h>

#include <kt/kt.h>

#include "lib/core/numa_internal.h"
#include "lib/kernels/registry.h"
#include "tools/kt-bench/limits.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LIMITS_HAVE_PEAK 1
#endif

typedef struct read_job {
    const float *data;
    double *partial; /* one per thread */
} read_job;

#ifdef LIMITS_HAVE_PEAK
__attribute__((target("avx512f"))) static void read_range_avx512(void *ctx, int64_t b, int64_t e,
                                                                 int thread)
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

/* The same on ymm for AVX2 machines (the plain loop is one serial chain of adds, far below the
 * memory's rate) */
__attribute__((target("avx2"))) static void read_range_avx2(void *ctx, int64_t b, int64_t e,
                                                            int thread)
{
    read_job *j = ctx;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(j->data + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(j->data + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(j->data + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(j->data + i + 24));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float s = 0.0f;
    for (int l = 0; l < 8; l++)
        s += lanes[l];
    for (; i < e; i++)
        s += j->data[i];
    j->partial[thread] += s;
}
#endif

static void read_range(void *ctx, int64_t b, int64_t e, int thread)
{
    read_job *j = ctx;
    float s = 0.0f;
    for (int64_t i = b; i < e; i++)
        s += j->data[i];
    j->partial[thread] += s;
}

struct bench_read_probe {
    float *data;
    int64_t n;
};

bench_read_probe *bench_read_probe_open(size_t bytes)
{
    bench_read_probe *p = calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    p->n = (int64_t)(bytes / sizeof(float));
    /* allocated as the layer's weights are (huge pages where large): from 4 KiB pages the loop
     * read 41-44 GB/s in a minute where the layer streamed its weights at 50 */
    if (kt__numa_alloc((size_t)p->n * sizeof(float), -1, (void **)&p->data) != KT_OK) {
        free(p);
        return NULL;
    }
    for (int64_t i = 0; i < p->n; i++) /* also faults every page in */
        p->data[i] = (float)(i & 7);
    return p;
}

double bench_read_probe_pass(bench_read_probe *p, kt_threadpool *pool)
{
    double partial[1024] = {0};
    read_job j = {p->data, partial};
    kt_range_fn fn = read_range;
#ifdef LIMITS_HAVE_PEAK
    if (kt_cpu_get_features()->avx512f)
        fn = read_range_avx512;
    else if (kt_cpu_get_features()->avx2)
        fn = read_range_avx2;
#endif
    const double t0 = bench_now_s();
    kt_parallel_for(pool, p->n, 1 << 16, fn, &j);
    const double dt = bench_now_s() - t0;
    return dt > 0 ? (double)p->n * sizeof(float) / dt * 1e-9 : 0.0;
}

void bench_read_probe_close(bench_read_probe *p)
{
    if (p == NULL)
        return;
    kt__numa_free(p->data, (size_t)p->n * sizeof(float), -1);
    free(p);
}

/* ---- register peak ---------------------------------------------------------------------- */

#define PEAK_ITERS (1 << 21) /* x 16 instructions x 64 flop */

#ifdef LIMITS_HAVE_PEAK
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float peak_loop(const float *seed)
{
    /* 16 named accumulators (an array of them may live in memory) */
#define PK_DECL(i) __m512 c##i = _mm512_set1_ps(seed[i])
    PK_DECL(0);
    PK_DECL(1);
    PK_DECL(2);
    PK_DECL(3);
    PK_DECL(4);
    PK_DECL(5);
    PK_DECL(6);
    PK_DECL(7);
    PK_DECL(8);
    PK_DECL(9);
    PK_DECL(10);
    PK_DECL(11);
    PK_DECL(12);
    PK_DECL(13);
    PK_DECL(14);
    PK_DECL(15);
#undef PK_DECL
    const __m512bh a = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(seed[16]));
    const __m512bh b = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(seed[17]));
    for (int it = 0; it < PEAK_ITERS; it++) {
#define PK(i) c##i = _mm512_dpbf16_ps(c##i, a, b)
        PK(0);
        PK(1);
        PK(2);
        PK(3);
        PK(4);
        PK(5);
        PK(6);
        PK(7);
        PK(8);
        PK(9);
        PK(10);
        PK(11);
        PK(12);
        PK(13);
        PK(14);
        PK(15);
#undef PK
    }
    const __m512 s = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                      _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)),
                      _mm512_add_ps(_mm512_add_ps(c12, c13), _mm512_add_ps(c14, c15))));
    return _mm512_reduce_add_ps(s);
}
#endif

#ifdef LIMITS_HAVE_PEAK
/* The same loop on vfmadd231ps (16 x 2 flop an instruction): the instruction of the widened
 * bf16 path (lib/kernels/fma_gemm.h). */
__attribute__((target("avx512f"))) static float fma_peak_loop(const float *seed)
{
    __m512 c[16];
    for (int i = 0; i < 16; i++)
        c[i] = _mm512_set1_ps(seed[i]);
    const __m512 a = _mm512_set1_ps(seed[16]), b = _mm512_set1_ps(seed[17]);
    for (int it = 0; it < PEAK_ITERS; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            c[i] = _mm512_fmadd_ps(c[i], a, b);
    }
    __m512 s = c[0];
    for (int i = 1; i < 16; i++)
        s = _mm512_add_ps(s, c[i]);
    return _mm512_reduce_add_ps(s);
}

/* vfmadd231ps on ymm (8 x 2 flop an instruction), the AVX2 paths' (lib/kernels/avx2_gemm.h):
 * 12 chains, enough to cover the FMA latency on both pipes, and with the two operands 14 of
 * the 16 ymm registers (16 chains would spill). Each chain is an accumulator (c += a b), as in
 * the kernels: on an AMD EPYC, chains through the multiplicand (c = c a + b, the zmm loop's
 * form) ran slower, below what the kernels reached (docs/moe-measurements.md, "AVX2
 * machines"). */
#define FMA256_CHAINS 12
__attribute__((target("avx2,fma"))) static float fma256_peak_loop(const float *seed)
{
    __m256 c[FMA256_CHAINS];
    for (int i = 0; i < FMA256_CHAINS; i++)
        c[i] = _mm256_set1_ps(seed[i]);
    const __m256 a = _mm256_set1_ps(seed[16]), b = _mm256_set1_ps(seed[17]);
    for (int it = 0; it < PEAK_ITERS; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < FMA256_CHAINS; i++)
            c[i] = _mm256_fmadd_ps(a, b, c[i]);
    }
    __m256 s = c[0];
    for (int i = 1; i < FMA256_CHAINS; i++)
        s = _mm256_add_ps(s, c[i]);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    return _mm_cvtss_f32(_mm_add_ps(h, _mm_movehl_ps(h, h)));
}
#endif

#ifdef LIMITS_HAVE_PEAK
/* tdpbf16ps on the AMX tiles (16 x 16 x 32 x 2 flop an instruction): four accumulator tiles,
 * each the product of one of two A tiles and one of two B tiles, so that consecutive products
 * do not wait on each other's result. The tiles' contents do not matter for the timing. */
#define AMX_PEAK_ITERS (PEAK_ITERS / 8)
__attribute__((target("amx-tile,amx-bf16"))) static float amx_peak_loop(const float *seed)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg = {.palette = 1};
    for (int t = 0; t < 8; t++)
        cfg.colsb[t] = 64, cfg.rows[t] = 16;
    static _Alignas(64) uint16_t ab[16 * 32];
    static _Alignas(64) float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++)
        ab[i] = 0x3f80; /* bf16 1.0 */
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    for (int it = 0; it < AMX_PEAK_ITERS; it++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] * seed[0];
}
#endif

static volatile float peak_sink;

/* The loops: what peak_part times. */
enum { LOOP_DPBF16, LOOP_FMA512, LOOP_FMA256, LOOP_AMX };

/* The path of large products, whose instruction bench_bf16_peak_* time. */
static const kt__kpath *large_path(void) { return kt__kpath_pick(KT__KP_TN_BF16, 1024); }

const char *bench_bf16_peak_name(void) { return kt__kinsn_names[large_path()->insn]; }

static void peak_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
#ifdef LIMITS_HAVE_PEAK
    const int loop = *(const int *)ctx;
    float seed[18];
    for (int i = 0; i < 18; i++)
        seed[i] = 1e-6f * (float)(i + 1);
    for (int64_t i = begin; i < end; i++)
        peak_sink = loop == LOOP_FMA512   ? fma_peak_loop(seed)
                    : loop == LOOP_FMA256 ? fma256_peak_loop(seed)
                    : loop == LOOP_AMX    ? amx_peak_loop(seed)
                                          : peak_loop(seed);
#else
    (void)ctx;
    (void)begin, (void)end;
#endif
}

/* The register peak of one loop. */
static double peak_gflops(kt_threadpool *pool, int threads, int repeats, int loop)
{
    double t[64];
    if (repeats > 64)
        repeats = 64;
    if (repeats < 1)
        repeats = 1;
    peak_part(&loop, 0, 1, 0); /* warm-up (clock ramp) */
    for (int r = 0; r < repeats; r++) {
        const double t0 = bench_now_s();
        kt_parallel_for(pool, threads, 1, peak_part, &loop);
        t[r] = bench_now_s() - t0;
    }
    const double per_iter = loop == LOOP_FMA512   ? 16.0 * 32.0
                            : loop == LOOP_FMA256 ? FMA256_CHAINS * 16.0
                            : loop == LOOP_AMX    ? 4.0 * 16 * 16 * 32 * 2 / 8 /* per PEAK_ITERS */
                                                  : 16.0 * 64.0;
    /* the best run, not the median: a peak is what the registers can do, and on a shared
     * machine a run cut by another process's time slice only hides it (the median let
     * kernels reach 1.3 of it there) */
    double best = t[0];
    for (int r = 1; r < repeats; r++)
        best = t[r] < best ? t[r] : best;
    return best > 0 ? (double)threads * PEAK_ITERS * per_iter / best * 1e-9 : 0.0;
}

double bench_bf16_peak_gflops(kt_threadpool *pool, int threads, int repeats)
{
    return bench_path_peak_gflops(large_path(), pool, threads, repeats);
}

int bench_fma_bits(void)
{
    const kt_cpu_features *f = kt_cpu_get_features();
    return f->avx512f && f->avx512bw ? 512 : f->avx2 ? 256 : 0;
}

double bench_fma_peak_gflops(kt_threadpool *pool, int threads, int repeats)
{
    const kt__kpath *p = kt__kpath_pick(KT__KP_TN_F32, 1024);
    return p->insn == KT__KINSN_FMA ? bench_path_peak_gflops(p, pool, threads, repeats) : 0.0;
}

double bench_path_peak_gflops(const kt__kpath *p, kt_threadpool *pool, int threads, int repeats)
{
    return bench_insn_peak_gflops(p->insn, p->bits, pool, threads, repeats);
}

double bench_insn_peak_gflops(kt__kinsn insn, int bits, kt_threadpool *pool, int threads,
                              int repeats)
{
    const kt_cpu_features *f = kt_cpu_get_features();
    switch (insn) {
    case KT__KINSN_FMA:
        if (bits == 512)
            return f->avx512f && f->avx512bw ? peak_gflops(pool, threads, repeats, LOOP_FMA512)
                                             : 0.0;
        if (bits == 256) /* (features.avx2 includes FMA) */
            return f->avx2 ? peak_gflops(pool, threads, repeats, LOOP_FMA256) : 0.0;
        return 0.0;
    case KT__KINSN_DPBF16:
        return f->avx512_bf16 ? peak_gflops(pool, threads, repeats, LOOP_DPBF16) : 0.0;
    case KT__KINSN_AMX: /* only where the tiles passed the library's self-test */
        return kt__kernel_features() & KT__KF_AMX ? peak_gflops(pool, threads, repeats, LOOP_AMX)
                                                  : 0.0;
    default: /* scalar: no peak */
        return 0.0;
    }
}
