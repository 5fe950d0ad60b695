/* kt-bench gemm --mixed (bench_gemm_dense.h): the matmul op on an f32 x and a bf16 (or f16) W,
 * y = x W^T as a LoRA fine-tune's frozen projection holds it (W [out, in], trans_b), against the
 * same op on f32 x and W widened to f32 (what a fine-tune without the mixed product keeps: an
 * f32 copy of every frozen weight). Two passes: the forward y = x W^T, and the backward's
 * gradient of x (dx = g W, W frozen: no gradient of W). The two dtypes' calls alternate one by
 * one, so a shared machine's load falls on both alike; medians. Beside them the vfmadd231ps peak
 * (the instruction both paths multiply with), the op's scratch and W's bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/kernels/mixed_matmul.h"
#include "lib/kernels/registry.h"
#include "lib/kernels/sgemm.h"
#include "tools/kt-bench/bench_gemm_dense.h"
#include "tools/kt-bench/limits.h"

static kt_tensor matrix(kt_dtype dt, int64_t rows, int64_t cols)
{
    kt_tensor t = {0};
    t.dtype = dt;
    t.ndim = 2;
    t.shape[0] = rows, t.shape[1] = cols;
    t.strides[0] = cols, t.strides[1] = 1;
    const size_t bytes = (size_t)(rows * cols) * kt_dtype_size(dt);
    t.data = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    return t;
}

static void fill(float *f, int64_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        f[i] = (float)((s * 0x2545F4914F6CDD1Dull) >> 40) / (float)(1 << 24) - 0.5f;
    }
}

typedef struct mixed_bufs {
    kt_tensor x, w, wf, y, g, dx; /* w: the narrow W; wf: W widened */
    void *scratch;
    size_t scratch_bytes, scratch_mixed_fwd, scratch_mixed_bwd;
} mixed_bufs;

static kt_op_attrs nt_attrs(void)
{
    kt_op_attrs at = kt_op_defaults(KT_OP_MATMUL);
    at.trans_b = 1;
    return at;
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

static int alloc_bufs(int64_t M, int64_t N, int64_t K, kt_dtype wdt, mixed_bufs *b)
{
    memset(b, 0, sizeof *b);
    b->x = matrix(KT_F32, M, K), b->wf = matrix(KT_F32, N, K), b->w = matrix(wdt, N, K);
    b->y = matrix(KT_F32, M, N), b->g = matrix(KT_F32, M, N), b->dx = matrix(KT_F32, M, K);
    if (!b->x.data || !b->wf.data || !b->w.data || !b->y.data || !b->g.data || !b->dx.data)
        return -1;
    fill(b->x.data, M * K, 1);
    fill(b->wf.data, N * K, 2);
    fill(b->g.data, M * N, 3);
    kt__unstage_f32(NULL, &b->w, b->wf.data); /* W rounded to its dtype */
    kt__stage_f32(NULL, b->wf.data, &b->w);   /* and the f32 copy of that W */
    const kt_op_attrs at = nt_attrs();
    const kt_tensor mix[2] = {b->x, b->w}, f32[2] = {b->x, b->wf};
    b->scratch_mixed_fwd = kt_op_scratch_bytes(KT_OP_MATMUL, &at, mix, 2, 0);
    b->scratch_mixed_bwd = kt_op_scratch_bytes(KT_OP_MATMUL, &at, mix, 2, 1);
    const size_t f = kt_op_scratch_bytes(KT_OP_MATMUL, &at, f32, 2, 0) >
                             kt_op_scratch_bytes(KT_OP_MATMUL, &at, f32, 2, 1)
                         ? kt_op_scratch_bytes(KT_OP_MATMUL, &at, f32, 2, 0)
                         : kt_op_scratch_bytes(KT_OP_MATMUL, &at, f32, 2, 1);
    b->scratch_bytes = max3(b->scratch_mixed_fwd, b->scratch_mixed_bwd, f) + 64;
    b->scratch = aligned_alloc(64, (b->scratch_bytes + 63) & ~(size_t)63);
    return b->scratch != NULL ? 0 : -1;
}

static void free_bufs(mixed_bufs *b)
{
    free(b->x.data), free(b->w.data), free(b->wf.data), free(b->y.data), free(b->g.data);
    free(b->dx.data), free(b->scratch);
}

/* one call: pass 0 the forward, 1 the gradient of x; narrow: W as it is, else widened */
static kt_status run_once(int pass, int narrow, mixed_bufs *b, kt_threadpool *pool)
{
    const kt_op_attrs at = nt_attrs();
    const kt_tensor in[2] = {b->x, narrow ? b->w : b->wf};
    const kt_exec ex = {pool, b->scratch, b->scratch_bytes};
    if (pass == 0)
        return kt_op_forward(KT_OP_MATMUL, &at, in, 2, &b->y, 1, &ex);
    kt_tensor gin[2] = {b->dx, in[1]};
    gin[1].data = NULL; /* W frozen */
    return kt_op_backward(KT_OP_MATMUL, &at, in, 2, &b->y, 1, &b->g, gin, &ex);
}

/* The vfmadd231ps peak at the width of the registry's MM_MIXED path for M rows; where that is
 * the scalar reference (the op runs the portable sgemm), at the widest this CPU has. */
static double mixed_peak(int64_t M, kt_threadpool *pool, int threads)
{
    const kt__kpath *p = kt__kpath_pick(KT__KP_MM_MIXED, M);
    return p->insn == KT__KINSN_FMA ? bench_path_peak_gflops(p, pool, threads, 5)
                                    : bench_insn_peak_gflops(KT__KINSN_FMA, bench_fma_bits(), pool,
                                                             threads, 5);
}

int bench_gemm_mixed(const bench_args *common, kt_threadpool *pool, int64_t m, int64_t n,
                     int64_t k, kt_dtype wdt, int single)
{
    const int64_t M = m > 0 ? m : 1024, N = n > 0 ? n : 2048, K = k > 0 ? k : 2048;
    kt_threadpool *use = single ? NULL : pool;
    const int threads = kt_threadpool_size(use);
    mixed_bufs b;
    if (alloc_bufs(M, N, K, wdt, &b) != 0) {
        fprintf(stderr, "kt-bench gemm: out of memory\n");
        free_bufs(&b);
        return 1;
    }
    const int total = common->warmup + common->repeats;
    double *tm = calloc((size_t)total, sizeof *tm), *tf = calloc((size_t)total, sizeof *tf);
    int rc = tm == NULL || tf == NULL;
    static const char *const pass_names[2] = {"fwd", "bwd_dx"};
    for (int pass = 0; pass < 2 && rc == 0; pass++) {
        const double peak_before = mixed_peak(M, use, threads);
        for (int i = 0; i < total && rc == 0; i++)
            for (int narrow = 1; narrow >= 0; narrow--) {
                const double t0 = bench_now_s();
                if (run_once(pass, narrow, &b, use) != KT_OK) {
                    fprintf(stderr, "kt-bench gemm: mixed: %s\n", kt_last_error());
                    rc = 1;
                    break;
                }
                (narrow ? tm : tf)[i] = bench_now_s() - t0;
            }
        if (rc != 0)
            break;
        const double peak_after = mixed_peak(M, use, threads);
        const double peak = peak_before > peak_after ? peak_before : peak_after;
        const double t = bench_median(tm + common->warmup, common->repeats);
        const double t32 = bench_median(tf + common->warmup, common->repeats);
        const double gf = 2.0 * (double)M * (double)N * (double)K / t * 1e-9;
        const double gf32 = 2.0 * (double)M * (double)N * (double)K / t32 * 1e-9;
        const char *path = kt__mixed_matmul_path(M); /* both passes' products have M rows */
        const size_t scratch = pass == 0 ? b.scratch_mixed_fwd : b.scratch_mixed_bwd;
        const size_t w_bytes = (size_t)(N * K) * kt_dtype_size(wdt);
        if (common->json)
            printf("{\"bench\":\"gemm_mixed\",\"config\":{\"pass\":\"%s\",\"m\":%lld,\"n\":%lld,"
                   "\"k\":%lld,\"a_dtype\":\"f32\",\"b_dtype\":\"%s\",\"trans_b\":true,"
                   "\"threads\":%d},\"path\":\"%s\",\"peak_insn\":\"vfmadd231ps\","
                   "\"median_ms\":%.4f,\"gflops\":%.2f,\"peak_gflops\":%.2f,"
                   "\"fraction_of_peak\":%s,\"f32_ms\":%.4f,\"f32_gflops\":%.2f,"
                   "\"f32_fraction_of_peak\":%s,\"ratio_vs_f32\":%s,\"scratch_bytes\":%zu,"
                   "\"b_bytes\":%zu,\"f32_b_bytes\":%zu,\"f32_sgemm\":\"%s\"}\n",
                   pass_names[pass], (long long)M, (long long)N, (long long)K,
                   kt_dtype_name(wdt), threads, path, t * 1e3, gf, peak,
                   BENCH_JNUM("%.4f", bench_ratio(gf, peak)), t32 * 1e3, gf32,
                   BENCH_JNUM("%.4f", bench_ratio(gf32, peak)),
                   BENCH_JNUM("%.3f", bench_ratio(t32, t)), scratch, w_bytes, (size_t)(N * K) * 4,
                   kt__sgemm_is_openblas() ? kt__sgemm_core_name() : "portable");
        else
            printf("mixed %-6s m=%-5lld n=%-5lld k=%-5lld f32 x %-4s thr=%d %-14s %9.3f ms "
                   "%7.1f GFLOP/s (%s of peak)  f32 x f32 %9.3f ms %7.1f GFLOP/s (%s)  "
                   "ratio_vs_f32 %.2fx  scratch %zu B, W %zu B (f32 copy %zu B)\n",
                   pass_names[pass], (long long)M, (long long)N, (long long)K,
                   kt_dtype_name(wdt), threads, path, t * 1e3, gf,
                   peak > 0 ? BENCH_JNUM("%.3f", gf / peak) : "n/a", t32 * 1e3, gf32,
                   peak > 0 ? BENCH_JNUM("%.3f", gf32 / peak) : "n/a", t32 / t, scratch, w_bytes,
                   (size_t)(N * K) * 4);
        fflush(stdout);
    }
    free(tm), free(tf);
    free_bufs(&b);
    return rc;
}
