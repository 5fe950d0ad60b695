/* kt-bench gemm: the MoE bf16 GEMM kernels (lib/kernels/bf16_gemm.h) against the register peak
 * of their instruction (vdpbf16ps, or vfmadd231ps where bf16 is widened) measured in the same
 * run.
 *
 * Each configuration is timed single-threaded (one call over the whole output) and on the
 * thread pool (the output columns, rows of dw for tn, cut statically over kt_parallel_for
 * in whole tiles). The weight operand (w for nt/nn, dw for tn) rotates through copies that
 * together exceed 64 MiB (twice this machine's L3), so weights come from memory as in a MoE
 * layer that touches each expert once per step; --hot keeps one copy. The activation operands'
 * rows are strided as the layer's (act_ld). The peak is a loop of
 * independent instructions on 16 accumulators in registers, on 1 thread and on all pool threads
 * at once, measured at the start, right before each timed configuration (the fraction of
 * peak uses that one, so a shared machine's load affects both alike) and at the end. GB/s
 * counts the weight operand's bytes (bf16 w; f32 dw read and written).
 *
 * Without --m/--n/--k it runs the MoE table: dsv2lite (H=2048, I=1408) and qwen3moe (H=2048,
 * I=768), m = 1, 8, 64, 256, 1024 tokens per expert, for each kind the gate/up shape
 * ("gu": M=m, N=I, K=H) and the down shape ("dn": M=m, N=H, K=I).
 *
 * The library peer: oneDNN's bf16 GEMM (the one PyTorch's bf16 matmuls use here) on the same
 * operands and thread count, where libdnnl.so.2 is installed (onednn_peer.c); each line then
 * carries ratio_vs_onednn = oneDNN's median time / libkt's. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "tools/kt-bench/bench_gemm_dense.h"
#include "tools/common/usage.h"
#include "tools/kt-bench/limits.h"
#include "lib/core/cpu_internal.h"
#include "lib/core/numa_internal.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/registry.h"
#include "tools/kt-bench/onednn_peer.h"

enum { K_NT = 0, K_NN = 1, K_TN = 2 };
static const char *const kind_names[3] = {"nt", "nn", "tn"};

/* ---- kernel runs -------------------------------------------------------------------------- */

typedef struct gemm_run {
    int kind;
    int64_t M, N, K;
    const uint16_t *a, *b; /* a: x (nt) or g (nn, tn); b: w (nt, nn) or x (tn) */
    int64_t lda, ldb;      /* their row strides */
    float *c;              /* y, or dw for tn */
    int64_t unit;          /* columns (rows of dw) per part unit: whole tiles */
    unsigned char *work;   /* tn: per thread, work_bytes each (NULL: the kernel needs none) */
    size_t work_bytes;
} gemm_run;

static int64_t split_dim(const gemm_run *r) { return r->kind == K_NN ? r->K : r->N; }

static void run_block(const gemm_run *r, int64_t s0, int64_t s1, int thread)
{
    switch (r->kind) {
    case K_NT:
        kt__bf16_gemm_nt(r->M, s0, s1, r->K, r->a, r->lda, r->b, r->ldb, r->c, r->N, 0);
        break;
    case K_NN:
        kt__bf16_gemm_nn(r->M, r->N, s0, s1, r->a, r->lda, r->b, r->ldb, r->c, r->K, 0);
        break;
    default:
        kt__bf16_gemm_tn_acc(r->M, s0, s1, r->K, r->a, r->lda, r->b, r->ldb, r->c, r->K, 1.0f,
                             r->work ? r->work + (size_t)thread * r->work_bytes : NULL);
        break;
    }
}

static void run_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    const gemm_run *r = ctx;
    const int64_t S = split_dim(r);
    const int64_t s0 = begin * r->unit, s1 = end * r->unit < S ? end * r->unit : S;
    if (s0 < s1)
        run_block(r, s0, s1, thread);
}

typedef struct buffers {
    uint16_t *act; /* the non-weight bf16 operands: x [M,K] / g [M,N] (and x for tn) */
    uint16_t *act2;
    int64_t ld_act, ld_act2; /* their row strides (act_ld) */
    uint16_t *wts;           /* copies of the bf16 weight (nt, nn), allocated as the layer's weights
                              * are (kt__numa_alloc: huge pages where large; with 4 KiB pages each row
                              * of a weight is a TLB miss, which drops the kernels' prefetches) */
    size_t wts_bytes;
    float *out; /* y (nt, nn) */
    float *dws; /* copies of dw (tn) */
    int copies;
    unsigned char *tn_work; /* tn: one work buffer per thread, as the layer keeps in scratch */
    size_t tn_work_bytes;
} buffers;

/* 64-byte aligned (as a layer's weight buffers are): rows then start on cache lines. */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

/* The row stride of an activation operand of `cols` bf16 columns, as the layer's (lib/moe:
 * ldh): a cache line more where the row's bytes are a multiple of 1 KiB, since rows 4 KiB
 * apart all fall in one L1 set (dense rows of 2048: x W^T about 1.5 % below the layer's) */
static int64_t act_ld(int64_t cols) { return cols + (cols * 2 % 1024 == 0 ? 32 : 0); }

static void fill_bf16(uint16_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        const float v = (float)((s * 0x2545F4914F6CDD1Dull) >> 40) / (float)(1 << 24) - 0.5f;
        p[i] = kt_f32_to_bf16_1(v);
    }
}

static int alloc_buffers(int kind, int64_t M, int64_t N, int64_t K, int hot, int threads,
                         buffers *bu)
{
    memset(bu, 0, sizeof *bu);
    const size_t wbytes = (size_t)(N * K) * (kind == K_TN ? sizeof(float) : sizeof(uint16_t));
    bu->copies = hot ? 1 : (int)((64u << 20) / (wbytes ? wbytes : 1) + 1);
    if (bu->copies > 256)
        bu->copies = 256;
    bu->ld_act = act_ld(kind == K_NT ? K : N);
    bu->ld_act2 = act_ld(K);
    const size_t na = (size_t)(M * bu->ld_act), na2 = (size_t)(M * bu->ld_act2);
    bu->act = alloc64((na ? na : 1) * sizeof(uint16_t));
    bu->act2 = alloc64((na2 ? na2 : 1) * sizeof(uint16_t));
    if (bu->act == NULL || bu->act2 == NULL)
        return -1;
    fill_bf16(bu->act, na, 1);
    fill_bf16(bu->act2, na2, 2);
    if (kind == K_TN) {
        const size_t nd = (size_t)bu->copies * (size_t)(N * K);
        bu->dws = alloc64((nd + 1) * sizeof(float));
        if (bu->dws == NULL)
            return -1;
        for (size_t i = 0; i < nd; i++) /* touch every page before timing */
            bu->dws[i] = 0.0f;
        bu->tn_work_bytes = kt__bf16_gemm_tn_work_bytes(M); /* whole cache lines */
        if (bu->tn_work_bytes > 0) {
            bu->tn_work = alloc64((size_t)threads * bu->tn_work_bytes);
            if (bu->tn_work == NULL)
                return -1;
            memset(bu->tn_work, 0, (size_t)threads * bu->tn_work_bytes);
        }
    } else {
        bu->wts_bytes = ((size_t)bu->copies * (size_t)(N * K) + 1) * sizeof(uint16_t);
        if (kt__numa_alloc(bu->wts_bytes, -1, (void **)&bu->wts) != KT_OK)
            bu->wts = NULL;
        bu->out = alloc64(((size_t)(M * (kind == K_NT ? N : K)) + 1) * sizeof(float));
        if (bu->wts == NULL || bu->out == NULL)
            return -1;
        memset(bu->out, 0, ((size_t)(M * (kind == K_NT ? N : K)) + 1) * sizeof(float));
        fill_bf16(bu->wts, (size_t)(N * K), 3);
        for (int c = 1; c < bu->copies; c++)
            memcpy(bu->wts + (size_t)c * (size_t)(N * K), bu->wts, (size_t)(N * K) * 2);
    }
    return 0;
}

static void free_buffers(buffers *bu)
{
    free(bu->act);
    free(bu->act2);
    kt__numa_free(bu->wts, bu->wts_bytes, -1);
    free(bu->out);
    free(bu->dws);
    free(bu->tn_work);
}

static gemm_run make_run(int kind, int64_t M, int64_t N, int64_t K, const buffers *bu, int copy)
{
    gemm_run r = {.kind = kind, .M = M, .N = N, .K = K};
    const size_t wsz = (size_t)(N * K);
    switch (kind) {
    case K_NT:
        r.a = bu->act, r.b = bu->wts + (size_t)copy * wsz, r.c = bu->out, r.unit = 6;
        r.lda = bu->ld_act, r.ldb = K;
        break;
    case K_NN:
        r.a = bu->act, r.b = bu->wts + (size_t)copy * wsz, r.c = bu->out, r.unit = 32;
        r.lda = bu->ld_act, r.ldb = K;
        break;
    default:
        r.a = bu->act, r.b = bu->act2, r.c = bu->dws + (size_t)copy * wsz, r.unit = 12;
        r.lda = bu->ld_act, r.ldb = bu->ld_act2;
        r.work = bu->tn_work, r.work_bytes = bu->tn_work_bytes;
        break;
    }
    return r;
}

/* oneDNN computes the same product as libkt (same operands, copy 0): the largest difference
 * relative to the largest magnitude, so a mis-specified peer call cannot pass for a fast one. */
static double peer_difference(int kind, int64_t M, int64_t N, int64_t K, const buffers *bu)
{
    gemm_run r = make_run(kind, M, N, K, bu, 0);
    const size_t n = (size_t)(kind == K_NT ? M * N : kind == K_NN ? M * K : N * K);
    float *mine = malloc(n * sizeof *mine);
    if (mine == NULL)
        return -1.0;
    if (kind == K_TN)
        memset(r.c, 0, n * sizeof *r.c);
    run_block(&r, 0, split_dim(&r), 0);
    memcpy(mine, r.c, n * sizeof *mine);
    /* tn adds to its output (zeros); nt/nn must overwrite a poisoned one */
    for (size_t i = 0; i < n; i++)
        r.c[i] = kind == K_TN ? 0.0f : NAN;
    const int status = onednn_peer_gemm(kind, M, N, K, r.a, r.lda, r.b, r.ldb, r.c, 1);
    double big = 0.0, diff = 0.0;
    int bad = status != 0;
    for (size_t i = 0; i < n && !bad; i++) {
        const double a = mine[i], d = fabs(a - (double)r.c[i]);
        bad = !(d == d); /* NaN: not written */
        big = fabs(a) > big ? fabs(a) : big;
        diff = d > diff ? d : diff;
    }
    free(mine);
    return bad ? -1.0 : big > 0 ? diff / big : diff;
}

typedef struct timing {
    double median_s, best_s;
} timing;

/* onednn_threads > 0: time oneDNN's GEMM on that many threads instead of libkt's kernels. */
static timing time_kernel(int kind, int64_t M, int64_t N, int64_t K, const buffers *bu,
                          kt_threadpool *pool, const bench_args *common, int onednn_threads)
{
    const int total = common->warmup + common->repeats;
    double *ts = calloc((size_t)total, sizeof *ts);
    timing out = {0, 0};
    if (ts == NULL)
        return out;
    for (int i = 0; i < total; i++) {
        gemm_run r = make_run(kind, M, N, K, bu, i % bu->copies);
        const int64_t units = (split_dim(&r) + r.unit - 1) / r.unit;
        const double t0 = bench_now_s();
        if (onednn_threads > 0)
            onednn_peer_gemm(kind, M, N, K, r.a, r.lda, r.b, r.ldb, r.c, onednn_threads);
        else if (pool == NULL)
            run_block(&r, 0, split_dim(&r), 0);
        else
            kt_parallel_for(pool, units, 1, run_part, &r);
        ts[i] = bench_now_s() - t0;
    }
    double best = ts[common->warmup];
    for (int i = common->warmup; i < total; i++)
        best = ts[i] < best ? ts[i] : best;
    out.median_s = bench_median(ts + common->warmup, common->repeats);
    out.best_s = best;
    free(ts);
    return out;
}

/* The kernel path a product runs (the registry's descriptor: it depends on the kind and the
 * rows), and the path whose sums it computes (the name the lines print as "path"). */
static const kt__kprod kind_prods[3] = {KT__KP_NT_BF16, KT__KP_NN_BF16, KT__KP_TN_BF16};
static const kt__kpath *kernel_path(int kind, int64_t M)
{
    return kt__kpath_pick(kind_prods[kind], M);
}

/* peer: oneDNN's timing on the same configuration (median_s 0: not measured) */
static void report(const bench_args *common, const char *model, const char *shape, int kind,
                   int64_t M, int64_t N, int64_t K, int threads, timing t, double peak, int hot,
                   timing peer)
{
    const double vs = peer.median_s > 0 ? peer.median_s / t.median_s : 0.0;
    const double flop = 2.0 * (double)M * (double)N * (double)K;
    const double gf = flop / t.median_s * 1e-9, gf_best = flop / t.best_s * 1e-9;
    const double wbytes = (double)N * (double)K * (kind == K_TN ? 8.0 : 2.0);
    const double gbs = wbytes / t.median_s * 1e-9;
    const kt__kpath *kp = kernel_path(kind, M);
    const char *path = kt__kpaths[kp->sums_as].name, *insn = kt__kinsn_names[kp->insn];
    if (common->json) {
        printf("{\"bench\":\"gemm\",\"model\":\"%s\",\"shape\":\"%s\",\"kind\":\"%s\","
               "\"path\":\"%s\",\"kernel\":\"%s\",\"peak_insn\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"threads\":%d,\"weights\":\"%s\","
               "\"median_ms\":%.4f,\"best_ms\":%.4f,\"gflops\":%.2f,\"gflops_best\":%.2f,"
               "\"peak_bits\":%d,\"peak_gflops\":%.2f,\"fraction_of_peak\":%s,\"weight_gbs\":%.2f,"
               "\"onednn_ms\":",
               model, shape, kind_names[kind], path, kp->name, insn, (long long)M, (long long)N,
               (long long)K, threads, hot ? "hot" : "cold", t.median_s * 1e3, t.best_s * 1e3, gf, gf_best,
               kp->bits, peak, BENCH_JNUM("%.4f", bench_ratio(gf, peak)), gbs);
        if (vs > 0)
            printf("%.4f,\"ratio_vs_onednn\":%.3f}\n", peer.median_s * 1e3, vs);
        else
            printf("null,\"ratio_vs_onednn\":null}\n");
    } else {
        printf("%-9s %-3s %-2s %-11s m=%-5lld n=%-5lld k=%-5lld thr=%d  %9.3f ms  %7.1f GFLOP/s "
               "(best %7.1f)  fraction_of_peak %s (%s)  weights %6.1f GB/s",
               model, shape, kind_names[kind], path, (long long)M, (long long)N, (long long)K,
               threads, t.median_s * 1e3, gf, gf_best,
               peak > 0 ? BENCH_JNUM("%.3f", gf / peak) : "n/a", insn, gbs);
        if (vs > 0)
            printf("  onednn %7.1f GFLOP/s: %.2fx\n", flop / peer.median_s * 1e-9, vs);
        else
            printf("\n");
    }
    fflush(stdout);
}

static int parse_kind(const char *s)
{
    for (int i = 0; i < 3; i++)
        if (strcmp(s, kind_names[i]) == 0)
            return i;
    return -1;
}

int bench_gemm(int argc, char **argv, const bench_args *common)
{
    long long m = -1, n = -1, k = -1;
    int kind = -1, hot = 0, single_only = 0, no_peer = 0, dense = 0, no_dense = 0;
    int no_baselines = 0, mixed = 0;
    kt_dtype mixed_dtype = KT_BF16;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench gemm [--m M] [--n N] [--k K] [--kind nt|nn|tn] [--hot]\n"
                   "                     [--single] [--json] [--repeats N] [--threads N]\n"
                   "                     [--dense | --no-dense] [--no-baselines] [--no-peer]\n"
                   "Times the bf16 MoE GEMM kernels on 1 thread and on the pool (--threads,\n"
                   "default: all CPUs) against the register peak of the instruction each\n"
                   "line's kernel multiplies with (vdpbf16ps, or vfmadd231ps where bf16 is\n"
                   "widened to f32; named on the line) measured right before it. Without\n"
                   "--m/--n/--k: the dsv2lite and qwen3moe expert shapes for m = 1, 8, 64,\n"
                   "256, 1024. Kernel sizes:\n"
                   "nt y[M,N] = x[M,K] w[N,K]^T, nn y[M,K] = g[M,N] w[N,K],\n"
                   "tn dw[N,K] += g[M,N]^T x[M,K]. Each line names the kernel's path\n"
                   "(by kind and rows; the registry's paths:");
            for (int p = 0; p < kt__kpath_count; p++)
                printf(" %s", kt__kpaths[p].name);
            printf(").\n"
                   "--hot: one weight copy (default: copies over 64 MiB, from memory);\n"
                   "--single: skip the pool runs. Beside each line: oneDNN's bf16 GEMM on\n"
                   "the same operands and threads (libdnnl.so.2, loaded if installed) and\n"
                   "its time over libkt's (> 1: libkt faster); --no-peer skips it.\n"
                   "After the MoE table (or alone with --dense; --no-dense skips it): the\n"
                   "dense bf16 matmul (y = x W^T through the op) at 2048^3, 512^3, 1024^3 and at the\n"
                   "attention projections of Mixtral and Qwen3-MoE for m = 1, 128, 1024\n"
                   "tokens (with --dense, --m/--n/--k give one product), against the peak of\n"
                   "its path's instruction, OpenBLAS's sgemm in f32 and the staged path it\n"
                   "replaced (bf16 widened to f32, sgemm, rounded); --no-baselines times\n"
                   "the op alone.\n"
                   "--mixed [--b-dtype bf16|f16]: the mixed-precision matmul alone, f32 x times\n"
                   "a bf16 (or f16) W (y = x W^T and the gradient of x, W frozen), against the\n"
                   "same op on W widened to f32, calls alternating; default 1024 x 2048 x 2048\n"
                   "(--m/--n/--k give another), with the vfmadd231ps peak.\n");
            return 0;
        } else if (strcmp(argv[i], "--m") == 0 && i + 1 < argc) {
            if (kt_tool_parse_int("kt-bench gemm", "--m", argv[++i], 1, 1 << 20, &m))
                return 2;
        } else if (strcmp(argv[i], "--n") == 0 && i + 1 < argc) {
            if (kt_tool_parse_int("kt-bench gemm", "--n", argv[++i], 1, 1 << 20, &n))
                return 2;
        } else if (strcmp(argv[i], "--k") == 0 && i + 1 < argc) {
            if (kt_tool_parse_int("kt-bench gemm", "--k", argv[++i], 1, 1 << 20, &k))
                return 2;
        } else if (strcmp(argv[i], "--kind") == 0 && i + 1 < argc) {
            kind = parse_kind(argv[++i]);
            if (kind < 0) {
                fprintf(stderr, "kt-bench gemm: --kind must be nt, nn or tn\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--hot") == 0) {
            hot = 1;
        } else if (strcmp(argv[i], "--single") == 0) {
            single_only = 1;
        } else if (strcmp(argv[i], "--no-peer") == 0) {
            no_peer = 1;
        } else if (strcmp(argv[i], "--dense") == 0) {
            dense = 1;
        } else if (strcmp(argv[i], "--no-dense") == 0) {
            no_dense = 1;
        } else if (strcmp(argv[i], "--no-baselines") == 0) {
            no_baselines = 1;
        } else if (strcmp(argv[i], "--mixed") == 0) {
            mixed = 1;
        } else if (strcmp(argv[i], "--b-dtype") == 0 && i + 1 < argc) {
            ++i;
            if (strcmp(argv[i], "bf16") == 0 || strcmp(argv[i], "f16") == 0) {
                mixed_dtype = argv[i][0] == 'b' ? KT_BF16 : KT_F16;
            } else {
                fprintf(stderr, "kt-bench gemm: --b-dtype must be bf16 or f16\n");
                return 2;
            }
        } else {
            fprintf(stderr, "kt-bench gemm: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    const int custom = m >= 0 || n >= 0 || k >= 0;
    if (custom && (m < 1 || n < 1 || k < 1)) {
        fprintf(stderr, "kt-bench gemm: --m, --n and --k go together and must be positive\n");
        return 2;
    }
    if (dense && (no_dense || kind >= 0)) {
        fprintf(stderr, "kt-bench gemm: --dense runs the matmul op alone (no --no-dense, --kind)\n");
        return 2;
    }
    if (mixed && (dense || no_dense || kind >= 0)) {
        fprintf(stderr, "kt-bench gemm: --mixed runs the mixed matmul alone (no --dense, "
                        "--no-dense, --kind)\n");
        return 2;
    }
    if (mixed) {
        kt_threadpool *mpool = NULL;
        if (kt_threadpool_create(common->threads_given ? common->threads : 0, &mpool) != KT_OK) {
            fprintf(stderr, "kt-bench gemm: %s\n", kt_last_error());
            return 1;
        }
        const int mrc = bench_gemm_mixed(common, mpool, custom ? m : 0, custom ? n : 0,
                                         custom ? k : 0, mixed_dtype, single_only);
        kt_threadpool_destroy(mpool);
        return mrc;
    }
    /* the path of products of 16 rows and more (below, vdpbf16ps where the CPU has it) */
    const char *path = kt__bf16_gemm_path(1024);
    const int vec = strcmp(path, "scalar") != 0;
    const int have_peak = vec; /* bench_bf16_peak_gflops gives 0 where it cannot measure */
    kt_threadpool *pool = NULL;
    /* (0: all CPUs; --threads 1 is one thread, as asked) */
    if (kt_threadpool_create(common->threads_given ? common->threads : 0, &pool) != KT_OK) {
        fprintf(stderr, "kt-bench gemm: %s\n", kt_last_error());
        return 1;
    }
    const int threads = kt_threadpool_size(pool);
    const double peak1 = have_peak ? bench_bf16_peak_gflops(NULL, 1, 7) : 0.0;
    const double peakp = have_peak ? bench_bf16_peak_gflops(pool, threads, 7) : 0.0;
    if (common->json)
        printf("{\"bench\":\"gemm_peak\",\"path\":\"%s\",\"peak_gflops_1\":%.2f,"
               "\"peak_gflops_pool\":%.2f,\"threads\":%d}\n",
               path, peak1, peakp, threads);
    else
        printf("bf16 gemm path: %s from 16 rows, %s below; %s register peak: %.1f GFLOP/s on 1 "
               "thread, %.1f on %d threads\n",
               path, kt__bf16_gemm_path(1), bench_bf16_peak_name(), peak1, peakp, threads);

    typedef struct model {
        const char *name;
        int64_t H, I;
    } model;
    static const model models[] = {{"dsv2lite", 2048, 1408}, {"qwen3moe", 2048, 768}};
    static const int64_t ms[] = {1, 8, 64, 256, 1024};
    const int n_models = custom ? 1 : 2, n_ms = custom ? 1 : 5;
    const int peer = !no_peer && onednn_peer_available();
    const timing none = {0, 0};
    if (!no_peer && !peer && !common->json)
        printf("note: oneDNN (libdnnl.so.2) not found: no library peer\n");
    int rc = 0;
    for (int mi = 0; mi < n_models && rc == 0 && !dense; mi++)
        for (int si = 0; si < n_ms && rc == 0; si++)
            for (int kd = 0; kd < 3 && rc == 0; kd++) {
                if (kind >= 0 && kd != kind)
                    continue;
                for (int sh = 0; sh < (custom ? 1 : 2); sh++) {
                    const int64_t M = custom ? m : ms[si];
                    const int64_t N = custom ? n : sh == 0 ? models[mi].I : models[mi].H;
                    const int64_t K = custom ? k : sh == 0 ? models[mi].H : models[mi].I;
                    const char *mname = custom ? "custom" : models[mi].name;
                    const char *sname = custom ? "-" : sh == 0 ? "gu" : "dn";
                    buffers bu;
                    if (alloc_buffers(kd, M, N, K, hot, threads, &bu) != 0) {
                        fprintf(stderr, "kt-bench gemm: out of memory\n");
                        free_buffers(&bu);
                        rc = 1;
                        break;
                    }
                    /* the peak again right before each run: the machine may be shared,
                     * and the fraction should compare like with like */
                    /* the peak of the instruction this product's kernel multiplies with */
                    const kt__kpath *kpath = kernel_path(kd, M);
                    const double pk1 = have_peak ? bench_path_peak_gflops(kpath, NULL, 1, 5) : 0.0;
                    timing t1 = time_kernel(kd, M, N, K, &bu, NULL, common, 0);
                    const double pd = peer ? peer_difference(kd, M, N, K, &bu) : 0.0;
                    /* a peer that computes something else gets no ratio (null) */
                    const int peer_ok = peer && pd >= 0 && pd <= 1e-3;
                    if (peer && !peer_ok)
                        fprintf(stderr,
                                "kt-bench gemm: oneDNN's result differs from libkt's "
                                "(%.3g relative): its timing is not reported\n",
                                pd);
                    timing p1 = peer_ok ? time_kernel(kd, M, N, K, &bu, NULL, common, 1) : none;
                    report(common, mname, sname, kd, M, N, K, 1, t1, pk1, hot, p1);
                    if (!single_only && threads > 1) {
                        const double pkp =
                            have_peak ? bench_path_peak_gflops(kpath, pool, threads, 5) : 0.0;
                        timing tp = time_kernel(kd, M, N, K, &bu, pool, common, 0);
                        timing pp =
                            peer_ok ? time_kernel(kd, M, N, K, &bu, NULL, common, threads) : none;
                        report(common, mname, sname, kd, M, N, K, threads, tp, pkp, hot, pp);
                    }
                    free_buffers(&bu);
                }
            }
    if (rc == 0 && (dense || (!custom && !no_dense && kind < 0)))
        rc = bench_gemm_dense(common, pool, custom ? m : 0, custom ? n : 0, custom ? k : 0,
                              single_only, !no_baselines);
    if (have_peak && !common->json)
        printf("%s register peak at the end: %.1f GFLOP/s on 1 thread, %.1f on %d\n",
               bench_bf16_peak_name(),
               bench_bf16_peak_gflops(NULL, 1, 7), bench_bf16_peak_gflops(pool, threads, 7),
               threads);
    kt_threadpool_destroy(pool);
    return rc;
}
