/* kt-bench gemm's dense part (bench_gemm_dense.h). y = x W^T as a projection holds it (W
 * [out, in], Hugging Face's layout: matmul with trans_b), bf16 x and W, bf16 y, through the
 * matmul op itself (kt_op_forward: the kernels and the final rounding). Beside it, in the same
 * run and on the same threads:
 *  - the register peak of the instruction its kernel path multiplies with (the registry's
 *    descriptor), right before the timed runs: fraction_of_peak;
 *  - OpenBLAS's sgemm on the same values in f32 (ratio_vs_openblas; null where the build has no
 *    OpenBLAS);
 *  - the staged path matmul ran before: x and W widened to f32, kt__sgemm, y rounded to bf16
 *    (ratio_vs_staged).
 * Shapes: M = N = K = 2048 ("square"), 512 and 1024, and the attention projections of Mixtral (H = 4096: q/o 4096 ->
 * 4096, k/v 4096 -> 1024) and Qwen3-MoE (H = 2048: q 2048 -> 4096, k/v 2048 -> 512, o 4096 ->
 * 2048) at M = 1, 128 and 1024 tokens. The operands stay in cache between runs (hot). */
#include "tools/kt-bench/bench_gemm_dense.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/kernels/bf16_matmul.h"
#include "lib/kernels/sgemm.h"
#include "tools/kt-bench/limits.h"

typedef struct dense_shape {
    const char *name;
    int64_t M, N, K;
} dense_shape;

typedef struct dense_bufs {
    kt_tensor x, w, y;     /* bf16: x [M,K], w [N,K], y [M,N] */
    float *xf, *wf, *yf;   /* f32 copies for OpenBLAS */
    void *scratch;         /* the op's scratch, then the staged path's */
    size_t scratch_bytes;
} dense_bufs;

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

static kt_tensor bf16_matrix(int64_t rows, int64_t cols)
{
    kt_tensor t = {0};
    t.dtype = KT_BF16;
    t.ndim = 2;
    t.shape[0] = rows, t.shape[1] = cols;
    t.strides[0] = cols, t.strides[1] = 1;
    t.data = alloc64((size_t)(rows * cols) * 2 + 64);
    return t;
}

static void fill(uint16_t *p, float *f, int64_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        const float v = (float)((s * 0x2545F4914F6CDD1Dull) >> 40) / (float)(1 << 24) - 0.5f;
        p[i] = kt_f32_to_bf16_1(v);
        f[i] = kt_bf16_to_f32_1(p[i]);
    }
}

/* y = x W^T, as a projection's weight [out, in] is stored */
static kt_op_attrs matmul_nt_attrs(void)
{
    kt_op_attrs at = kt_op_defaults(KT_OP_MATMUL);
    at.trans_b = 1;
    return at;
}

static int dense_alloc(const dense_shape *s, dense_bufs *b)
{
    memset(b, 0, sizeof *b);
    b->x = bf16_matrix(s->M, s->K), b->w = bf16_matrix(s->N, s->K), b->y = bf16_matrix(s->M, s->N);
    b->xf = alloc64((size_t)(s->M * s->K) * 4), b->wf = alloc64((size_t)(s->N * s->K) * 4);
    b->yf = alloc64((size_t)(s->M * s->N) * 4);
    const kt_op_attrs at = matmul_nt_attrs();
    const kt_tensor in[2] = {b->x, b->w};
    const size_t op = kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 0);
    const size_t staged = kt__f32_scratch_bytes(s->M * s->K) + kt__f32_scratch_bytes(s->N * s->K) +
                          kt__f32_scratch_bytes(s->M * s->N);
    b->scratch_bytes = op > staged ? op : staged;
    b->scratch = alloc64(b->scratch_bytes);
    if (!b->x.data || !b->w.data || !b->y.data || !b->xf || !b->wf || !b->yf || !b->scratch)
        return -1;
    fill(b->x.data, b->xf, s->M * s->K, 1);
    fill(b->w.data, b->wf, s->N * s->K, 2);
    return 0;
}

static void dense_free(dense_bufs *b)
{
    free(b->x.data), free(b->w.data), free(b->y.data);
    free(b->xf), free(b->wf), free(b->yf), free(b->scratch);
}

enum { RUN_OP = 0, RUN_OPENBLAS = 1, RUN_STAGED = 2 };

static kt_status run_once(int what, const dense_shape *s, dense_bufs *b, kt_threadpool *pool)
{
    const kt_op_attrs at = matmul_nt_attrs();
    const kt_tensor in[2] = {b->x, b->w};
    if (what == RUN_OP) {
        const kt_exec ex = {pool, b->scratch, b->scratch_bytes};
        return kt_op_forward(KT_OP_MATMUL, &at, in, 2, &b->y, 1, &ex);
    }
    if (what == RUN_OPENBLAS)
        return kt__sgemm_openblas(pool, 0, 1, s->M, s->N, s->K, 1.0f, b->xf, s->K, b->wf, s->K,
                                  0.0f, b->yf, s->N);
    /* the staged path: what matmul's bf16 forward did before the bf16 kernels */
    char *cursor = b->scratch;
    const float *xf = kt__stage_operand(pool, &in[0], &cursor);
    const float *wf = kt__stage_operand(pool, &in[1], &cursor);
    float *yf = kt__scratch_take(&cursor, s->M * s->N);
    kt_status st = kt__sgemm(pool, 0, 1, s->M, s->N, s->K, 1.0f, xf, s->K, wf, s->K, 0.0f, yf,
                             s->N);
    if (st == KT_OK)
        kt__unstage_f32(pool, &b->y, yf);
    return st;
}

/* the median seconds of one run, or -1 when it fails */
static double time_runs(int what, const dense_shape *s, dense_bufs *b, kt_threadpool *pool,
                        const bench_args *common)
{
    const int total = common->warmup + common->repeats;
    double *ts = calloc((size_t)total, sizeof *ts);
    if (ts == NULL)
        return -1.0;
    for (int i = 0; i < total; i++) {
        const double t0 = bench_now_s();
        if (run_once(what, s, b, pool) != KT_OK) {
            free(ts);
            return -1.0;
        }
        ts[i] = bench_now_s() - t0;
    }
    const double med = bench_median(ts + common->warmup, common->repeats);
    free(ts);
    return med;
}

static void report(const bench_args *common, const dense_shape *s, int threads, double t,
                   double peak, const kt__kpath *path, double t_blas, double t_staged,
                   int have_blas)
{
    const double gf = 2.0 * (double)s->M * (double)s->N * (double)s->K / t * 1e-9;
    const double frac = peak > 0 ? gf / peak : 0.0;
    const char *insn = kt__kinsn_names[path->insn];
    if (common->json) {
        printf("{\"bench\":\"gemm_dense\",\"config\":{\"shape\":\"%s\",\"m\":%lld,\"n\":%lld,"
               "\"k\":%lld,\"dtype\":\"bf16\",\"trans_b\":true,\"threads\":%d},\"path\":\"%s\","
               "\"peak_insn\":\"%s\",\"peak_bits\":%d,\"median_ms\":%.4f,\"gflops\":%.2f,"
               "\"peak_gflops\":%.2f,",
               s->name, (long long)s->M, (long long)s->N, (long long)s->K, threads, path->name,
               insn, path->bits, t * 1e3, gf, peak);
        if (peak > 0)
            printf("\"fraction_of_peak\":%.4f,", frac);
        else
            printf("\"fraction_of_peak\":null,");
        if (have_blas && t_blas > 0)
            printf("\"openblas_ms\":%.4f,\"ratio_vs_openblas\":%s,", t_blas * 1e3,
                   BENCH_JNUM("%.3f", t_blas / t));
        else
            printf("\"openblas_ms\":null,\"ratio_vs_openblas\":null,\"note\":\"%s\",",
                   t_staged > 0 ? "no OpenBLAS in this build" : "--no-baselines");
        if (t_staged > 0)
            printf("\"staged_ms\":%.4f,\"ratio_vs_staged\":%s}\n", t_staged * 1e3,
                   BENCH_JNUM("%.3f", t_staged / t));
        else
            printf("\"staged_ms\":null,\"ratio_vs_staged\":null}\n");
    } else {
        printf("dense %-10s m=%-5lld n=%-5lld k=%-5lld thr=%d %-11s %9.3f ms %7.1f GFLOP/s  "
               "fraction_of_peak %.3f (%s)",
               s->name, (long long)s->M, (long long)s->N, (long long)s->K, threads, path->name,
               t * 1e3, gf, frac, insn);
        if (have_blas && t_blas > 0)
            printf("  openblas %.2fx", t_blas / t);
        if (t_staged > 0)
            printf("  staged %.2fx", t_staged / t);
        printf("\n");
    }
    fflush(stdout);
}

int bench_gemm_dense(const bench_args *common, kt_threadpool *pool, int64_t m, int64_t n,
                     int64_t k, int single, int baselines)
{
    static const dense_shape table[] = {
        {"square", 2048, 2048, 2048},   {"square_512", 512, 512, 512},
        {"square_1024", 1024, 1024, 1024},
        {"mixtral_q", 1, 4096, 4096},   {"mixtral_kv", 1, 1024, 4096},
        {"qwen3_q", 1, 4096, 2048},     {"qwen3_kv", 1, 512, 2048},
        {"qwen3_o", 1, 2048, 4096},
    };
    static const int64_t tokens[] = {1, 128, 1024};
    kt_threadpool *use = single ? NULL : pool;
    const int threads = kt_threadpool_size(use);
    const int have_blas = baselines && strcmp(kt__sgemm_core_name(), "portable") != 0;
    const int custom = m > 0 && n > 0 && k > 0;
    const int n_shapes = custom ? 1 : (int)(sizeof table / sizeof table[0]);
    const int n_squares = 3; /* the table's first rows: M fixed, no token counts */
    for (int i = 0; i < n_shapes; i++)
        for (int ti = 0; ti < (custom || i < n_squares ? 1 : 3); ti++) {
            dense_shape s = custom ? (dense_shape){"custom", m, n, k} : table[i];
            if (!custom && i >= n_squares)
                s.M = tokens[ti];
            dense_bufs b;
            if (dense_alloc(&s, &b) != 0) {
                fprintf(stderr, "kt-bench gemm: out of memory\n");
                dense_free(&b);
                return 1;
            }
            const kt__kpath *path = kt__bf16_matmul_path(1, s.M);
            const double peak = bench_path_peak_gflops(path, use, threads, 5);
            const double t = time_runs(RUN_OP, &s, &b, use, common);
            const double tb = have_blas ? time_runs(RUN_OPENBLAS, &s, &b, use, common) : -1.0;
            const double tst = baselines ? time_runs(RUN_STAGED, &s, &b, use, common) : 0.0;
            if (t <= 0 || (baselines && tst <= 0)) {
                fprintf(stderr, "kt-bench gemm: dense %s: %s\n", s.name, kt_last_error());
                dense_free(&b);
                return 1;
            }
            report(common, &s, threads, t, peak, path, tb, tst, have_blas);
            dense_free(&b);
        }
    return 0;
}
