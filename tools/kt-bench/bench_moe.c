/* kt-bench moe: the CPU MoE layer against this machine's limits and PyTorch's usual loop.
 *
 * In one run: libkt's forward and forward+backward on random weights and a softmax-top-k
 * routing (as the research baselines), the bf16 GEMMs' register peak, the memory read
 * bandwidth, OpenBLAS sgemm on the same per-expert shapes and the FMA peak (f32), and PyTorch's
 * index_select / F.linear / index_add_ loop on the same inputs through moe_torch_peer.py
 * (in bf16 and in f32) when /usr/bin/python3 has torch and safetensors, its calls alternating
 * with libkt's (moe_peer.h); with --dtype int8|int4 also KTransformers' kt-kernel INT8 / INT4
 * SFT MoE on the same weights (moe_ktkernel_peer.py, in kt-kernel's own virtual environment)
 * when it is installed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "tools/common/usage.h"
#include "tools/kt-bench/limits.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/quant_gemm.h"
#include "tools/kt-bench/moe_peer.h"
#include "lib/kernels/sgemm.h"

#ifndef KT_BENCH_PEER_SCRIPT
#define KT_BENCH_PEER_SCRIPT "tools/kt-bench/moe_torch_peer.py"
#endif
#ifndef KT_BENCH_KTK_PEER_SCRIPT
#define KT_BENCH_KTK_PEER_SCRIPT "tools/kt-bench/moe_ktkernel_peer.py"
#endif
/* kt-kernel's virtual environment (it pins its own torch): --ktkernel-python replaces it */
#ifndef KT_BENCH_KTK_PYTHON
#define KT_BENCH_KTK_PYTHON "/work/venv-ktk/bin/python"
#endif

/* The peers: torch bf16, torch f32, kt-kernel (quantized runs only) */
#define N_PEERS 3
#define PEER_KTK 2

typedef struct shape {
    const char *name;
    int64_t hidden, inter, experts, top_k;
} shape;

static const shape shapes[] = {
    {"small", 512, 256, 16, 2}, {"dsv2lite", 2048, 1408, 64, 6}, {"qwen3moe", 2048, 768, 128, 8}};

typedef struct moe_args {
    const shape *shape;
    int64_t qlen;
    kt_moe_mode mode;
    kt_dtype dtype;    /* the weights' (bf16 for quantized experts) */
    kt_moe_quant quant; /* --dtype int8 / int4 */
    int group;         /* --group: int4's inputs per scale */
    int peer;
    unsigned peer_dtypes; /* bit 0: bf16, bit 1: f32 */
    const char *peer_script;
    const char *ktk_python; /* kt-kernel's venv python (--ktkernel-python) */
    const char *ktk_script; /* moe_ktkernel_peer.py */
    int numa_split; /* --numa-split: experts split over the NUMA nodes */
    int phases;     /* --phases: where the time goes, per phase of the layer */
    int recompute;  /* --recompute: the layer keeps no intermediates (keep_activations 0) */
} moe_args;

typedef struct moe_inputs {
    kt_tensor x, ids, w, gy, gx, gw, y;
    int32_t *ids0;   /* the ids drawn (ids holds them shifted: rotate_ids) */
    int64_t shift;   /* experts a call's ids move on from the last's (pick_shift) */
    int64_t active;  /* experts that receive at least one token */
    int64_t *counts; /* tokens per expert */
} moe_inputs;

/* At qlen <= 16 a call touches a few experts (dsv2lite at one token: 6, 104 MB), and calls
 * with the same ids found part of them still in the 32 MiB L3: the layer "streamed" 1.1-1.3
 * times the read loop's bandwidth. There call c's ids are the drawn ones shifted by
 * (c mod ID_ROTATIONS) * shift experts (mod E: the same routing on other experts), the shift
 * the smallest from E / ID_ROTATIONS on that moves the drawn experts onto none of them, so
 * that a call shares no expert with the one before (where no shift does, as at 16 tokens,
 * which touch most experts, a call's hundreds of MB are far more than the L3 anyway); the
 * peer shifts its ids alike (--rotate, --shift). */
#define ID_ROTATIONS 8

static int64_t pick_shift(const moe_inputs *in, int64_t E)
{
    const int64_t first = E / ID_ROTATIONS > 0 ? E / ID_ROTATIONS : 1;
    for (int64_t d = first; d < E; d++) {
        int64_t e = 0;
        while (e < E && !(in->counts[e] > 0 && in->counts[(e + d) % E] > 0))
            e++;
        if (e == E)
            return d;
    }
    return first;
}

static void rotate_ids(moe_inputs *in, int64_t E, int64_t call)
{
    if (in->ids0 == NULL) /* out of memory at make_inputs: the drawn ids every call */
        return;
    const int64_t shift = call % ID_ROTATIONS * in->shift % E;
    const int64_t n = kt_tensor_numel(&in->ids);
    for (int64_t i = 0; i < n; i++)
        ((int32_t *)in->ids.data)[i] = (int32_t)((in->ids0[i] + shift) % E);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static double uniform(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (double)((rng * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}

static double normal(void)
{
    return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform());
}

static kt_tensor alloc(kt_dtype dtype, int64_t a, int64_t b)
{
    kt_tensor t;
    int64_t shape2[2] = {a, b};
    kt_tensor_init(&t, NULL, dtype, 2, shape2);
    t.data = calloc(1, kt_tensor_nbytes(&t) + 64);
    return t;
}

static void set_f(kt_tensor *t, int64_t i, float v)
{
    if (t->dtype == KT_F32)
        ((float *)t->data)[i] = v;
    else
        ((uint16_t *)t->data)[i] = kt_f32_to_bf16_1(v);
}

/* Routing as the baselines do it: softmax over random logits, the top k. */
static void make_inputs(const moe_args *a, moe_inputs *in)
{
    const shape *s = a->shape;
    int64_t T = a->qlen, E = s->experts, K = s->top_k, H = s->hidden;
    in->x = alloc(KT_F32, T, H);
    in->gy = alloc(KT_F32, T, H);
    in->gx = alloc(KT_F32, T, H);
    in->y = alloc(KT_F32, T, H);
    in->ids = alloc(KT_I32, T, K);
    in->w = alloc(KT_F32, T, K);
    in->gw = alloc(KT_F32, T, K);
    in->counts = calloc((size_t)E, sizeof *in->counts);
    for (int64_t i = 0; i < T * H; i++) {
        ((float *)in->x.data)[i] = (float)normal();
        ((float *)in->gy.data)[i] = (float)normal() * 0.01f;
    }
    double *logits = malloc(sizeof *logits * (size_t)E);
    for (int64_t t = 0; t < T; t++) {
        double mx = -1e300, sum = 0;
        for (int64_t e = 0; e < E; e++) {
            logits[e] = normal();
            mx = logits[e] > mx ? logits[e] : mx;
        }
        for (int64_t e = 0; e < E; e++)
            sum += exp(logits[e] - mx);
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (logits[e] > -1e299 && (best < 0 || logits[e] > logits[best]))
                    best = e;
            ((int32_t *)in->ids.data)[t * K + k] = (int32_t)best;
            ((float *)in->w.data)[t * K + k] = (float)(exp(logits[best] - mx) / sum);
            in->counts[best]++;
            logits[best] = -1e300;
        }
    }
    free(logits);
    in->ids0 = malloc(sizeof *in->ids0 * (size_t)(T * K));
    if (in->ids0 != NULL)
        memcpy(in->ids0, in->ids.data, sizeof *in->ids0 * (size_t)(T * K));
    in->active = 0;
    for (int64_t e = 0; e < E; e++)
        in->active += in->counts[e] > 0;
    in->shift = pick_shift(in, E);
}

static void free_inputs(moe_inputs *in)
{
    kt_tensor *all[] = {&in->x, &in->ids, &in->w, &in->gy, &in->gx, &in->gw, &in->y};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]->data);
    free(in->counts);
    free(in->ids0);
}

/* The weights, drawn once and set into each layer given (a quantized layer quantizes them; the
 * bf16 twin of a quantized run gets the same draws). */
static int fill_weights(kt_moe *const *layers, int n, const moe_args *a)
{
    const shape *s = a->shape;
    float scale_in = 1.0f / sqrtf((float)s->hidden), scale_mid = 1.0f / sqrtf((float)s->inter);
    int rc = 0;
    for (int64_t e = 0; e < s->experts && rc == 0; e++)
        for (int p = 0; p < 3 && rc == 0; p++) {
            kt_tensor w = p == KT_MOE_DOWN ? alloc(a->dtype, s->hidden, s->inter)
                                           : alloc(a->dtype, s->inter, s->hidden);
            if (w.data == NULL)
                return 1;
            float sc = p == KT_MOE_DOWN ? scale_mid : scale_in;
            /* uniform with the normal's variance: cheap for a billion weights */
            for (int64_t i = 0; i < kt_tensor_numel(&w); i++)
                set_f(&w, i, (float)((uniform() - 0.5) * 3.4641016 * sc));
            for (int l = 0; l < n && rc == 0; l++)
                rc = kt_moe_set_weight(layers[l], e, (kt_moe_proj)p, &w) != KT_OK;
            free(w.data);
        }
    return rc;
}

/* FLOPs as the baselines count them: 3 GEMMs of 2*H*I per (token, expert) forward, 3 more for
 * the input gradients, 3 more for the weight gradients (full). */
static double flops(const moe_args *a, int backward)
{
    double pairs = (double)a->qlen * (double)a->shape->top_k;
    double per = 2.0 * (double)a->shape->hidden * (double)a->shape->inter * 3.0;
    if (!backward)
        return pairs * per;
    return pairs * per * (a->mode == KT_MOE_FULL ? 3.0 : 2.0);
}

/* OpenBLAS (kt__sgemm_openblas, whatever kt__sgemm chooses) on the same per-expert shapes, in
 * the same order: the f32 limit the issue names. */
static double sgemm_rate_gflops(const moe_args *a, const moe_inputs *in, kt_threadpool *pool)
{
    const shape *s = a->shape;
    int64_t H = s->hidden, I = s->inter, maxm = 0;
    for (int64_t e = 0; e < s->experts; e++)
        maxm = in->counts[e] > maxm ? in->counts[e] : maxm;
    float *x = calloc((size_t)(maxm * H + 16), sizeof *x), *y = calloc((size_t)(maxm * H + 16), 4);
    float *w = calloc((size_t)(H * I + 16), sizeof *w), *h = calloc((size_t)(maxm * I + 16), 4);
    double best = 1e300;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = bench_now_s();
        for (int64_t e = 0; e < s->experts; e++) {
            int64_t m = in->counts[e];
            if (m == 0)
                continue;
            kt__sgemm_openblas(pool, 0, 1, m, I, H, 1.0f, x, H, w, H, 0.0f, h, I);
            kt__sgemm_openblas(pool, 0, 1, m, I, H, 1.0f, x, H, w, H, 0.0f, h, I);
            kt__sgemm_openblas(pool, 0, 1, m, H, I, 1.0f, h, I, w, I, 0.0f, y, H);
        }
        double dt = bench_now_s() - t0;
        best = dt < best ? dt : best;
    }
    free(x), free(y), free(w), free(h);
    return flops(a, 0) / best * 1e-9;
}

/* The register peak of the layer's GEMM instruction: bf16's (vdpbf16ps, or vfmadd231ps where
 * bf16 is widened), vfmadd231ps for f32 on the layer's own kernels, 0 for f32 through sgemm. */
static double register_peak(const moe_args *a, kt_threadpool *pool)
{
    const int threads = kt_threadpool_size(pool);
    if (a->dtype == KT_BF16)
        return bench_bf16_peak_gflops(pool, threads, 5);
    return kt__f32_gemm_tiled() ? bench_fma_peak_gflops(pool, threads, 5) : 0.0;
}

static const char *const mode_names[] = {"frozen", "lora", "full"};

/* "bf16", "f32", "int8", "int4" */
static const char *dtype_name(const moe_args *a)
{
    return a->quant ? kt_moe_quant_name(a->quant) : kt_dtype_name(a->dtype);
}

/* The JSON "config" object of a line, and its comma. */
static void print_config(const moe_args *a, int pass, int threads)
{
    printf("\"config\":{\"shape\":\"%s\",\"qlen\":%lld,\"mode\":\"%s\",\"dtype\":\"%s\","
           "\"pass\":\"%s\",\"threads\":%d,\"recompute\":%s},",
           a->shape->name, (long long)a->qlen, mode_names[a->mode], dtype_name(a),
           pass ? "fwdbwd" : "fwd", threads, a->recompute ? "true" : "false");
}

/* Writes the inputs as safetensors for the PyTorch peer. */
static int write_peer_inputs(kt_moe *m, const moe_args *a, const moe_inputs *in, const char *path)
{
    const shape *s = a->shape;
    int64_t E = s->experts, H = s->hidden, I = s->inter;
    kt_dtype wd = a->dtype;
    kt_tensor gate, up, down;
    int64_t gshape[3] = {E, I, H}, dshape[3] = {E, H, I};
    kt_tensor_init(&gate, NULL, wd, 3, gshape);
    kt_tensor_init(&up, NULL, wd, 3, gshape);
    kt_tensor_init(&down, NULL, wd, 3, dshape);
    size_t per = (size_t)(H * I) * kt_dtype_size(wd);
    gate.data = malloc(per * (size_t)E);
    up.data = malloc(per * (size_t)E);
    down.data = malloc(per * (size_t)E);
    int rc = gate.data && up.data && down.data ? 0 : 1;
    for (int64_t e = 0; e < E && rc == 0; e++) {
        kt_tensor *dst[3] = {&gate, &up, &down};
        for (int p = 0; p < 3 && rc == 0; p++) {
            /* the values the layer multiplies by (a quantized layer's dequantized ones) */
            kt_tensor v;
            const int64_t sh[2] = {dst[p]->shape[1], dst[p]->shape[2]};
            kt_tensor_init(&v, (char *)dst[p]->data + (size_t)e * per, wd, 2, sh);
            rc = kt_moe_get_weight(m, e, (kt_moe_proj)p, &v) != KT_OK;
        }
    }
    kt_st_item items[] = {{"gate", gate},   {"up", up},   {"down", down},    {"x", in->x},
                          {"ids", in->ids}, {"w", in->w}, {"grad_y", in->gy}};
    if (rc == 0 && kt_st_save(path, items, sizeof items / sizeof items[0], NULL) != KT_OK)
        rc = 1;
    free(gate.data), free(up.data), free(down.data);
    return rc;
}

static int parse(int argc, char **argv, moe_args *a)
{
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
            printf("usage: kt-bench moe [--shape small|dsv2lite|qwen3moe] [--qlen N]\n"
                   "                    [--mode frozen|lora|full] [--dtype bf16|f32|int8|int4]\n"
                   "                    [--group 32|64|128]\n"
                   "                    [--no-peer] [--peer-dtype bf16|f32|both] [--peer-script "
                   "PATH]\n"
                   "                    [--ktkernel-python PATH]\n"
                   "                    [--threads N] [--numa-split] [--phases] [--recompute]\n"
                   "                    [--json]\n"
                   "Times the MoE layer forward and forward+backward; prints tokens/s,\n"
                   "GFLOP/s, the fraction of the bf16 GEMMs' register peak (vdpbf16ps, or\n"
                   "vfmadd231ps where bf16 is widened to f32; there also the fraction of\n"
                   "the vdpbf16ps peak, the issue's measure) or of OpenBLAS sgemm on\n"
                   "the same per-expert shapes (f32; with OpenBLAS's kernel set named, and\n"
                   "the fraction of the vfmadd231ps peak where the layer's own f32 kernels\n"
                   "run; KT_CPU=blas runs the layer on sgemm instead), the fraction of\n"
                   "memory bandwidth for qlen <= 16, and the ratio against PyTorch's loop\n"
                   "in bf16 and f32.\n"
                   "With --dtype int8|int4 also against KTransformers' kt-kernel INT8 / INT4\n"
                   "SFT MoE (moe_ktkernel_peer.py: AMXINT8/AMXINT4_SFT_SkipLoRA for frozen,\n"
                   "AMXINT8/AMXINT4_SFT with rank-8 adapters for lora) on the same\n"
                   "(dequantized) weights, which kt-kernel quantizes into its own format,\n"
                   "when kt-kernel's virtual environment is found: --ktkernel-python PATH,\n"
                   "default " KT_BENCH_KTK_PYTHON " (KT_KERNEL_CPU_VARIANT in the\n"
                   "environment picks its build); ratio_vs_ktkernel_int8 / _int4 is\n"
                   "kt-kernel's time over libkt's (>1: libkt faster). Not found, or failed:\n"
                   "a note and a null ratio.\n"
                   "Defaults: --shape small --qlen 128 --mode frozen --dtype bf16, all CPUs.\n"
                   "The peer (moe_torch_peer.py, one process per dtype) times one call\n"
                   "per request; its calls alternate with libkt's, call by call above qlen 16\n"
                   "(20 ms between the two processes' calls), as one block each at qlen <= 16.\n"
                   "A peer that does not answer in 5 minutes (10 to start; the environment's\n"
                   "KT_BENCH_PEER_TIMEOUT_S, seconds, replaces both) is killed: null ratio.\n"
                   "At qlen <= 16 the forward also runs with each call right after a pass of\n"
                   "a plain read loop over 256 MiB; the fraction of memory bandwidth is the\n"
                   "median over those calls of the call's rate (bytes of the experts it\n"
                   "touches / its time) over the pass just before it, and the GB/s printed the\n"
                   "passes' median (also printed: those calls' median rate over the fastest\n"
                   "pass); the time printed is of calls without the passes, as the peer's. There\n"
                   "each call's expert ids are the drawn ones shifted by a multiple of a shift\n"
                   "of at least E/8 (both sides), so that no call finds the last one's experts\n"
                   "still in the CPU's caches.\n"
                   "--numa-split: a NUMA-placed pool and the experts split over the nodes\n"
                   "(KT_MOE_NUMA_SPLIT; the same as without on a one-node machine).\n"
                   "--phases: also the time of each phase of the layer per call, averaged\n"
                   "over the timed runs of each pass (kt_moe_get_phase_times).\n"
                   "--recompute: the layer keeps no gate/up intermediates for backward and\n"
                   "recomputes them there (keep_activations 0, as a checkpointed program\n"
                   "advises); the saved bytes per token printed drop accordingly. GFLOP/s\n"
                   "counts the layer's FLOPs once, not the recomputed ones.\n");
            exit(0);
        }
        static const char *const with_value[] = {
            "--shape", "--qlen", "--mode", "--dtype", "--peer-dtype", "--peer-script", "--group",
            "--ktkernel-python"};
        if (v == NULL &&
            bench_is_one_of(s, with_value, (int)(sizeof with_value / sizeof with_value[0]))) {
            fprintf(stderr, "kt-bench moe: %s needs a value (see --help)\n", s);
            return 2;
        }
        if (strcmp(s, "--shape") == 0) {
            a->shape = NULL;
            for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
                if (strcmp(v, shapes[k].name) == 0)
                    a->shape = &shapes[k];
            if (a->shape == NULL) {
                fprintf(stderr, "kt-bench moe: unknown shape '%s'\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(s, "--qlen") == 0) {
            long long q;
            if (kt_tool_parse_int("kt-bench moe", "--qlen", v, 1, 1 << 20, &q))
                return 2;
            a->qlen = q;
            i++;
        } else if (strcmp(s, "--mode") == 0) {
            a->mode = strcmp(v, "lora") == 0   ? KT_MOE_LORA
                      : strcmp(v, "full") == 0 ? KT_MOE_FULL
                                               : KT_MOE_FROZEN;
            if (strcmp(v, "frozen") && strcmp(v, "lora") && strcmp(v, "full")) {
                fprintf(stderr, "kt-bench moe: unknown mode '%s'\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(s, "--dtype") == 0) {
            a->quant = strcmp(v, "int8") == 0   ? KT_MOE_QUANT_INT8
                       : strcmp(v, "int4") == 0 ? KT_MOE_QUANT_INT4
                                                : KT_MOE_QUANT_NONE;
            if (strcmp(v, "bf16") != 0 && strcmp(v, "f32") != 0 && a->quant == KT_MOE_QUANT_NONE) {
                fprintf(stderr, "kt-bench moe: --dtype is bf16, f32, int8 or int4, got '%s'\n", v);
                return 2;
            }
            a->dtype = strcmp(v, "f32") == 0 ? KT_F32 : KT_BF16;
            i++;
        } else if (strcmp(s, "--group") == 0) {
            a->group = atoi(v);
            if (a->group != 32 && a->group != 64 && a->group != 128) {
                fprintf(stderr, "kt-bench moe: --group is 32, 64 or 128, got '%s'\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(s, "--no-peer") == 0) {
            a->peer = 0;
        } else if (strcmp(s, "--numa-split") == 0) {
            a->numa_split = 1;
        } else if (strcmp(s, "--phases") == 0) {
            a->phases = 1;
        } else if (strcmp(s, "--recompute") == 0) {
            a->recompute = 1;
        } else if (strcmp(s, "--peer-dtype") == 0) {
            a->peer_dtypes = strcmp(v, "bf16") == 0 ? 1u : strcmp(v, "f32") == 0 ? 2u : 3u;
            if (strcmp(v, "bf16") && strcmp(v, "f32") && strcmp(v, "both")) {
                fprintf(stderr, "kt-bench moe: --peer-dtype is bf16, f32 or both\n");
                return 2;
            }
            i++;
        } else if (strcmp(s, "--peer-script") == 0) {
            a->peer_script = v;
            i++;
        } else if (strcmp(s, "--ktkernel-python") == 0) {
            a->ktk_python = v;
            i++;
        } else {
            fprintf(stderr, "kt-bench moe: unknown option %s (see --help)\n", s);
            return 2;
        }
    }
    return 0; /* (--qlen is checked as it is parsed) */
}

/* Against the memory bandwidth (qlen <= 16), each call comes right after a pass of the read
 * loop: this VM's bandwidth moves between about 50 and 90 GB/s from one minute to the next,
 * and a read loop measured before and after the calls (the higher kept) judged calls made at
 * 50 against 90 when it changed in between. Interleaved, each call is judged against the
 * pass just before it. The pass also leaves nothing of the last call in the caches. */
typedef struct bw_judge {
    bench_read_probe *probe; /* NULL: no bandwidth figure */
    kt_threadpool *pool;     /* the layer's, which reads the probe too */
    double touched;          /* bytes of expert weights a call reads */
    double gbs;              /* out: median GB/s of the read passes before the timed calls */
    double fraction;         /* out: median over those calls of (touched / time) / pass GB/s */
    double best_gbs;         /* out: the fastest of those passes */
    double best_fraction;    /* out: the strictest figure, (touched / the calls' median
                              * time) / best_gbs */
} bw_judge;

/* The peers (torch bf16, torch f32, kt-kernel; NULL: not run), whose calls alternate with libkt's in blocks
 * of `block` calls of each: the same minutes of this VM (its speed drifts by the minute)
 * measure both, and the ratio with them. Calls of a few ms come in one block each, as the
 * calls of a layer in a model come in quick succession: after a pause a call first wakes
 * threads and finds the clock lowered (at dsv2lite qlen 1 that doubled libkt's time). */
typedef struct peers {
    moe_peer *p[N_PEERS];
    int block;
    double ms[N_PEERS]; /* out: each one's median time per call (-1: it failed) */
    char (*note)[320]; /* why one failed */
} peers;

/* The median time of `repeats` calls after `warmup`; the layer's phase times over the timed
 * calls into *phases. rotate: E to shift the ids call by call (rotate_ids), 0 to keep them.
 * bw (NULL: none): the read pass before each call, and the figures of bw_judge. pe (NULL:
 * none): each peer's call on the same ids after each of libkt's, and their medians. */
static double time_median(kt_moe *m, moe_inputs *in, int backward, int warmup, int repeats,
                          int64_t rotate, bw_judge *bw, peers *pe, kt_moe_phase_times *phases)
{
    const size_t n = (size_t)(warmup + repeats);
    double *t = calloc(n, sizeof *t), *gbs = calloc(n, sizeof *gbs);
    double *frac = calloc(n, sizeof *frac), *pt = calloc(N_PEERS * n, sizeof *pt);
    if (t == NULL || gbs == NULL || frac == NULL || pt == NULL) {
        fprintf(stderr, "kt-bench moe: out of memory\n");
        free(t), free(gbs), free(frac), free(pt);
        return -1;
    }
    for (int r = 0; r < warmup + repeats; r++) {
        if (rotate > 0)
            rotate_ids(in, rotate, r);
        if (r == warmup)
            kt_moe_reset_phase_times(m);
        /* each fwd+bwd is a training step of one micro-batch, as the peer's zero_grad(set_to_
         * none): the weight/LoRA gradients are overwritten, not added to */
        if (backward)
            kt_moe_zero_grad(m);
        if (bw && bw->probe)
            gbs[r] = bench_read_probe_pass(bw->probe, bw->pool);
        double t0 = bench_now_s();
        if (kt_moe_forward(m, &in->x, &in->ids, &in->w, &in->y) != KT_OK ||
            (backward && kt_moe_backward(m, &in->gy, &in->gx, &in->gw, 1.0f) != KT_OK)) {
            fprintf(stderr, "kt-bench moe: %s\n", kt_last_error());
            free(t), free(gbs), free(frac), free(pt);
            return -1;
        }
        t[r] = bench_now_s() - t0;
        frac[r] =
            bw && bw->probe && t[r] > 0 && gbs[r] > 0 ? bw->touched / t[r] * 1e-9 / gbs[r] : 0.0;
        /* after each block of libkt's calls, the peers' same calls */
        const int last = r + 1 == warmup + repeats;
        for (int k = 0; pe && k < N_PEERS && ((r + 1) % pe->block == 0 || last); k++) {
            if (moe_peer_failed(pe->p[k]))
                continue;
            moe_peer_gap();
            for (int q = r - r % pe->block; q <= r; q++)
                pt[k * n + (size_t)q] =
                    moe_peer_call(pe->p[k], backward, q, pe->note[k], sizeof pe->note[k]);
            moe_peer_gap();
        }
    }
    double med = bench_median(t + warmup, repeats);
    for (int k = 0; pe && k < N_PEERS; k++) {
        int ok = pe->p[k] != NULL;
        for (int r = 0; ok && r < warmup + repeats; r++)
            ok = pt[k * n + (size_t)r] > 0;
        pe->ms[k] = ok ? bench_median(pt + k * n + warmup, repeats) : -1.0;
    }
    if (bw && bw->probe) {
        bw->gbs = bench_median(gbs + warmup, repeats);
        bw->fraction = bench_median(frac + warmup, repeats);
        bw->best_gbs = 0.0;
        for (int r = warmup; r < warmup + repeats; r++)
            bw->best_gbs = gbs[r] > bw->best_gbs ? gbs[r] : bw->best_gbs;
        bw->best_fraction =
            med > 0 && bw->best_gbs > 0 ? bw->touched / med * 1e-9 / bw->best_gbs : 0.0;
    }
    free(t), free(gbs), free(frac), free(pt);
    kt_moe_get_phase_times(m, phases);
    return med;
}

/* A field of a peer's {"ready": ...} line (Python's json.dumps: "key": "text" or "key": 1.5)
 * into out, as text; "" when absent. */
static void ready_field(const char *ready, const char *key, char *out, size_t size)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(ready, pat);
    out[0] = '\0';
    if (p == NULL || size == 0)
        return;
    p += strlen(pat);
    const int quoted = *p == '"';
    p += quoted;
    size_t n = 0;
    while (p[n] != '\0' && (quoted ? p[n] != '"' : p[n] != ',' && p[n] != '}'))
        n++;
    if (!quoted && n == 4 && strncmp(p, "null", 4) == 0)
        n = 0;
    snprintf(out, size, "%.*s", (int)n, p);
}

/* kt-kernel's INT8 / INT4 SFT MoE as a peer (moe_ktkernel_peer.py in its virtual
 * environment); NULL with the reason in note (320 bytes) when it is not found or fails. */
static moe_peer *ktk_peer_start(const moe_args *a, const char *inputs, int threads, int rotate,
                                int64_t shift, int verbose, char *ready, size_t ready_size,
                                char *note)
{
    const size_t note_size = 320;
    char label[40];
    snprintf(label, sizeof label, "kt-kernel %s", dtype_name(a));
    if (access(a->ktk_python, X_OK) != 0) {
        snprintf(note, note_size,
                 "%s peer not run: no %.120s (kt-kernel's venv; --ktkernel-python PATH)",
                 label, a->ktk_python);
        return NULL;
    }
    if (a->mode == KT_MOE_FULL) {
        snprintf(note, note_size, "%s peer not run: its SFT classes train no quantized base "
                                  "weights (full mode)", label);
        return NULL;
    }
    char th[16], rot[16], sh[24];
    snprintf(th, sizeof th, "%d", threads);
    snprintf(rot, sizeof rot, "%d", rotate);
    snprintf(sh, sizeof sh, "%lld", (long long)shift);
    const char *const args[] = {a->ktk_script, inputs,    "--mode",  mode_names[a->mode],
                                "--dtype",     dtype_name(a), "--threads", th,
                                "--rotate",    rot,       "--shift", sh};
    if (verbose)
        fprintf(stderr, "kt-bench moe: starting the %s peer (%s)...\n", label, a->ktk_python);
    return bench_peer_start(a->ktk_python, args, (int)(sizeof args / sizeof args[0]), label,
                            ready, ready_size, note, note_size);
}

int bench_moe(int argc, char **argv, const bench_args *common)
{
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--ranks") == 0 || strcmp(argv[i], "--parallel") == 0)
            return bench_moe_ranks(argc, argv, common); /* several ranks: bench_moe_ranks.c */
    static char peer_found[4096], ktk_found[4096];
    moe_args a = {.shape = &shapes[0],
                  .qlen = 128,
                  .mode = KT_MOE_FROZEN,
                  .dtype = KT_BF16,
                  .peer = 1,
                  .peer_dtypes = 3u,
                  .peer_script = bench_find_script(KT_BENCH_PEER_SCRIPT, "moe_torch_peer.py",
                                                   peer_found, sizeof peer_found),
                  .ktk_python = KT_BENCH_KTK_PYTHON,
                  .ktk_script = bench_find_script(KT_BENCH_KTK_PEER_SCRIPT,
                                                  "moe_ktkernel_peer.py", ktk_found,
                                                  sizeof ktk_found)};
    int rc = parse(argc, argv, &a);
    if (rc != 0)
        return rc;
    int threads = common->threads_given ? common->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    kt_threadpool *pool;
    if ((a.numa_split ? kt_threadpool_create_numa(threads, &pool)
                      : kt_threadpool_create(threads, &pool)) != KT_OK) {
        fprintf(stderr, "kt-bench moe: %s\n", kt_last_error());
        return 1;
    }
    const shape *s = a.shape;
    kt_moe_config cfg = {.n_experts = s->experts,
                         .hidden = s->hidden,
                         .intermediate = s->inter,
                         .top_k = s->top_k,
                         .max_tokens = a.qlen,
                         .weight_dtype = a.dtype,
                         .act_dtype = KT_F32,
                         .mode = a.mode,
                         .lora_rank = 8,
                         .lora_alpha = 16.0f,
                         .keep_activations = !a.recompute,
                         .name = "bench",
                         .numa_node = a.numa_split ? KT_MOE_NUMA_SPLIT : -1,
                         .quant = a.quant,
                         .quant_group = a.group};
    /* quantized experts: a bf16 layer on the same weights, timed in the same run */
    kt_moe_config twin_cfg = cfg;
    twin_cfg.quant = KT_MOE_QUANT_NONE;
    twin_cfg.name = "bench-bf16";
    kt_moe *layers[2] = {NULL, NULL};
    const int n_layers = a.quant ? 2 : 1;
    if (kt_moe_create(&cfg, pool, &layers[0]) != KT_OK ||
        (a.quant && kt_moe_create(&twin_cfg, pool, &layers[1]) != KT_OK) ||
        fill_weights(layers, n_layers, &a) != 0) {
        fprintf(stderr, "kt-bench moe: %s\n", kt_last_error());
        kt_moe_destroy(layers[0]), kt_moe_destroy(layers[1]);
        kt_threadpool_destroy(pool);
        return 1;
    }
    kt_moe *m = layers[0];
    kt_moe_memory mem;
    kt_moe_get_memory(m, &mem);
    moe_inputs in;
    make_inputs(&a, &in);
    if (!common->json)
        fprintf(stderr, "kt-bench moe: %s qlen=%lld %s %s, %d threads: measuring...\n", s->name,
                (long long)a.qlen,
                a.mode == KT_MOE_FULL   ? "full"
                : a.mode == KT_MOE_LORA ? "lora"
                                        : "frozen",
                dtype_name(&a), threads);
    /* a call at qlen <= 16 takes milliseconds: many more of them, so that the median is not
     * one of a few calls a moment's disturbance of this shared machine slowed */
    const int small = a.qlen <= 16;
    int reps = common->repeats < 5 ? common->repeats : 5;
    if (small)
        reps = 31;
    if (common->repeats_given)
        reps = common->repeats;
    /* the register peak before and after the timed runs, the higher kept: a peak measured
     * while something else ran on the machine would flatter every fraction */
    double reg_peak = register_peak(&a, pool);
    const int f32_fma = a.dtype == KT_F32 && kt__f32_gemm_tiled();
    /* the read bandwidth in passes between the forward calls (bw_judge) */
    bw_judge bw = {.probe = small ? bench_read_probe_open(256u << 20) : NULL,
                   .pool = pool,
                   /* the bytes the layer reads of each active expert: its share of the store
                    * (a quantized layer's values and scales) */
                   .touched = (double)in.active * (double)mem.weight_bytes / (double)s->experts,
                   .fraction = -1.0};
    if (small && bw.probe == NULL)
        fprintf(stderr, "kt-bench moe: no memory for the read loop: no bandwidth figure\n");
    /* the PyTorch peers, on the same inputs (the drawn ids), in bf16 and in f32: started
     * now, called between libkt's calls */
    char note[N_PEERS][320] = {"", "", ""};
    char ktk_ready[2048] = "";
    peers pe = {{NULL, NULL, NULL}, small ? 2 + reps : 1, {-1.0, -1.0, -1.0}, note};
    char path[256];
    snprintf(path, sizeof path, "/tmp/kt-bench-moe-%d.safetensors", (int)getpid());
    if (!a.peer) {
        snprintf(note[0], sizeof note[0], "peer not run (--no-peer)");
    } else if (write_peer_inputs(m, &a, &in, path) != 0) {
        snprintf(note[0], sizeof note[0], "could not write the peer's inputs");
    } else {
        const char *dts[2] = {"bf16", "f32"};
        for (int k = 0; k < 2; k++) {
            if (!(a.peer_dtypes & (1u << k))) {
                snprintf(note[k], sizeof note[k], "torch %s peer not run (--peer-dtype)", dts[k]);
                continue;
            }
            if (!common->json)
                fprintf(stderr, "kt-bench moe: starting the torch %s peer...\n", dts[k]);
            pe.p[k] = moe_peer_start(a.peer_script, path, mode_names[a.mode], dts[k], threads,
                                     small ? ID_ROTATIONS : 1, in.shift, note[k], sizeof note[k]);
        }
        if (a.quant)
            pe.p[PEER_KTK] = ktk_peer_start(&a, path, threads, small ? ID_ROTATIONS : 1,
                                            in.shift, !common->json, ktk_ready,
                                            sizeof ktk_ready, note[PEER_KTK]);
    }
    unlink(path); /* the peers have read it */

    kt_moe_phase_times ph[2];
    const int64_t rotate = small ? s->experts : 0;
    /* the forward twice at qlen <= 16: after read passes for the bandwidth figure, and as the
     * peer's calls are (no pass before them, alternating with the peers') for the time, the
     * ratio and the phases */
    double fwd_judged = bw.probe ? time_median(m, &in, 0, 2, reps, rotate, &bw, NULL, &ph[0]) : 0.0;
    bench_read_probe_close(bw.probe);
    double t_fwd[N_PEERS], t_fb[N_PEERS];
    double fwd = time_median(m, &in, 0, 2, reps, rotate, NULL, &pe, &ph[0]);
    memcpy(t_fwd, pe.ms, sizeof t_fwd);
    double fwdbwd = time_median(m, &in, 1, 2, reps, rotate, NULL, &pe, &ph[1]);
    memcpy(t_fb, pe.ms, sizeof t_fb);
    for (int k = 0; k < N_PEERS; k++)
        moe_peer_stop(pe.p[k]);
    /* the bf16 twin's fwd and fwd+bwd on the same calls */
    kt_moe_phase_times twin_ph;
    double twin[2] = {-1.0, -1.0};
    if (a.quant) {
        twin[0] = time_median(layers[1], &in, 0, 2, reps, rotate, NULL, NULL, &twin_ph);
        twin[1] = time_median(layers[1], &in, 1, 2, reps, rotate, NULL, NULL, &twin_ph);
    }
    kt_moe_destroy(layers[1]);
    if (fwd_judged < 0 || fwd < 0 || fwdbwd < 0 || (a.quant && (twin[0] < 0 || twin[1] < 0))) {
        free_inputs(&in);
        kt_moe_destroy(m);
        kt_threadpool_destroy(pool);
        return 1;
    }

    /* the limits, measured now: bf16 against its register peak; f32 against OpenBLAS on the
     * same shapes (the limit) and, on the layer's own kernels, the FMA peak too */
    const double after = register_peak(&a, pool);
    reg_peak = after > reg_peak ? after : reg_peak;
    const double peak = a.dtype == KT_BF16 ? reg_peak : sgemm_rate_gflops(&a, &in, pool);
    const double fma_peak = a.dtype == KT_BF16 ? 0.0 : reg_peak;
    /* Where bf16 runs on the FMA units, the issue's own measure too: the vdpbf16ps peak (on
     * Intel it issues at a quarter of the FMA rate, so this fraction is the looser one). */
    const kt__kinsn large = kt__kpath_pick(KT__KP_TN_BF16, 1024)->insn;
    const double dp_peak = a.dtype == KT_BF16 && large != KT__KINSN_DPBF16
                               ? bench_insn_peak_gflops(KT__KINSN_DPBF16, 512, pool, threads, 5)
                               : 0.0;
    int have[N_PEERS];
    for (int k = 0; k < N_PEERS; k++)
        have[k] = t_fwd[k] > 0 && t_fb[k] > 0;
    /* what kt-kernel ran, from its ready line */
    char ktk_class[96], ktk_variant[48], ktk_version[32], ktk_err[32];
    ready_field(ktk_ready, "class", ktk_class, sizeof ktk_class);
    ready_field(ktk_ready, "cpu_variant", ktk_variant, sizeof ktk_variant);
    ready_field(ktk_ready, "ktkernel_version", ktk_version, sizeof ktk_version);
    ready_field(ktk_ready, "rel_err_fwd", ktk_err, sizeof ktk_err);
    char peak_name[48];
    snprintf(peak_name, sizeof peak_name, "%s peak", bench_bf16_peak_name());

    for (int pass = 0; pass < 2; pass++) {
        double t = pass ? fwdbwd : fwd;
        double gf = flops(&a, pass) / t * 1e-9;
        double frac_peak = peak > 0 ? gf / peak : 0.0;
        double frac_bw = pass ? -1.0 : bw.fraction;
        double ratio[N_PEERS];
        for (int k = 0; k < N_PEERS; k++)
            ratio[k] = have[k] ? (pass ? t_fb[k] : t_fwd[k]) * 1e-3 / t : -1.0;
        if (common->json) {
            printf("{\"bench\":\"moe\",");
            print_config(&a, pass, threads);
            printf("\"%s_ms\":%.4f,\"tokens_per_s\":%.1f,\"gflops\":%.2f,", pass ? "fwdbwd" : "fwd",
                   t * 1e3, (double)a.qlen / t, gf);
            /* the path of the layer's large products, whose peak this is (scalar: none, null) */
            printf("\"gemm_path\":\"%s\",", a.dtype == KT_BF16 ? kt__bf16_gemm_path(1024)
                                               : f32_fma       ? kt__f32_gemm_path("nn", 1024)
                                                               : "sgemm");
            printf("\"%s\":%.2f,\"fraction_of_peak\":%s,",
                   a.dtype == KT_BF16 ? "peak_gflops" : "sgemm_gflops", peak,
                   BENCH_JNUM("%.3f", bench_ratio(gf, peak)));
            if (dp_peak > 0)
                printf("\"dpbf16_peak_gflops\":%.2f,\"fraction_of_dpbf16_peak\":%s,", dp_peak,
                       BENCH_JNUM("%.3f", gf / dp_peak));
            if (a.dtype == KT_F32) {
                printf("\"sgemm_core\":\"%s\",\"f32_kernels\":\"%s\",", kt__sgemm_core_name(),
                       f32_fma ? "fma" : "sgemm");
                if (fma_peak > 0)
                    printf("\"fma_peak_gflops\":%.2f,\"fraction_of_fma_peak\":%s,", fma_peak,
                           BENCH_JNUM("%.3f", gf / fma_peak));
            }
            if (frac_bw >= 0)
                printf("\"bandwidth_gbs\":%.2f,\"fraction_of_bandwidth\":%s,"
                       "\"bandwidth_best_gbs\":%.2f,\"fraction_of_best_bandwidth\":%s,",
                       bw.gbs, BENCH_JNUM("%.3f", frac_bw), bw.best_gbs,
                       BENCH_JNUM("%.3f", bw.best_fraction));
            else
                printf("\"fraction_of_bandwidth\":null,");
            for (int k = 0; k < 2; k++) {
                if (have[k])
                    printf("\"ratio_vs_torch_%s\":%s,", k ? "f32" : "bf16",
                           BENCH_JNUM("%.3f", ratio[k]));
                else
                    printf("\"ratio_vs_torch_%s\":null,", k ? "f32" : "bf16");
            }
            if (a.quant) {
                /* kt-kernel's INT8 / INT4 SFT MoE on the same weights (null: not run) */
                printf("\"ratio_vs_ktkernel_%s\":%s,", dtype_name(&a),
                       have[PEER_KTK] ? BENCH_JNUM("%.3f", ratio[PEER_KTK]) : "null");
                if (have[PEER_KTK]) {
                    printf("\"ktkernel_%s_ms\":%.4f,\"ktkernel_class\":\"", pass ? "fwdbwd" : "fwd",
                           pass ? t_fb[PEER_KTK] : t_fwd[PEER_KTK]);
                    bench_print_json_text(ktk_class);
                    printf("\",\"ktkernel_cpu_variant\":\"");
                    bench_print_json_text(ktk_variant);
                    printf("\",\"ktkernel_version\":\"");
                    bench_print_json_text(ktk_version);
                    printf("\",\"ktkernel_rel_err_fwd\":%s,", ktk_err[0] ? ktk_err : "null");
                }
            }
            if (a.quant)
                printf("\"quant_group\":%d,\"quant_path\":\"%s\",\"bf16_%s_ms\":%.4f,"
                       "\"ratio_vs_bf16\":%s,\"weight_bytes_ratio_vs_bf16\":%.4f,",
                       a.quant == KT_MOE_QUANT_INT4 ? (a.group ? a.group : 64) : 0,
                       kt__q_gemm_path(pass, a.qlen * s->top_k / s->experts + 1),
                       pass ? "fwdbwd" : "fwd", twin[pass] * 1e3,
                       BENCH_JNUM("%.3f", twin[pass] / t),
                       (double)mem.weight_bytes / (double)mem.raw_weight_bytes);
            printf("\"weight_bytes_ratio\":%.4f,\"backward_buffer_bytes\":%llu,"
                   "\"saved_bytes_per_token\":%llu",
                   (double)mem.weight_bytes / (double)mem.raw_weight_bytes,
                   (unsigned long long)mem.backward_buffer_bytes,
                   (unsigned long long)mem.saved_bytes_per_token);
            if (note[0][0] || note[1][0] || note[2][0]) { /* a peer's message may hold JSON */
                printf(",\"note\":\"");
                for (int k = 0, first = 1; k < N_PEERS; k++)
                    if (note[k][0]) {
                        printf("%s", first ? "" : "; ");
                        bench_print_json_text(note[k]);
                        first = 0;
                    }
                printf("\"");
            }
            printf("}\n");
        } else {
            printf("moe %s qlen=%lld %s%s %s %s: %.3f ms, %.0f tokens/s, %.1f GFLOP/s, %.3f of "
                   "the %s (%.1f GFLOP/s",
                   s->name, (long long)a.qlen, mode_names[a.mode],
                   a.recompute ? " (recompute)" : "", dtype_name(&a),
                   pass ? "fwd+bwd" : "fwd", t * 1e3, (double)a.qlen / t, gf, frac_peak,
                   a.dtype == KT_BF16 ? peak_name : "OpenBLAS sgemm rate", peak);
            if (a.dtype == KT_F32)
                printf(", its %s kernels", kt__sgemm_core_name());
            printf(")");
            if (fma_peak > 0)
                printf(", %.3f of the vfmadd231ps peak (%.1f GFLOP/s)", gf / fma_peak, fma_peak);
            if (dp_peak > 0)
                printf(", %.3f of the vdpbf16ps peak (%.1f GFLOP/s)", gf / dp_peak, dp_peak);
            if (frac_bw >= 0)
                printf(", %.3f of %.1f GB/s memory bandwidth (%.3f of the best read pass, %.1f)",
                       frac_bw, bw.gbs, bw.best_fraction, bw.best_gbs);
            for (int k = 0; k < 2; k++)
                if (have[k])
                    printf(", %.2fx torch %s", ratio[k], k ? "f32" : "bf16");
            if (a.quant)
                printf(", %.2fx bf16 experts (%.3f ms)", twin[pass] / t, twin[pass] * 1e3);
            if (have[PEER_KTK])
                printf(", %.2fx kt-kernel %s (%s, %s build, %.3f ms)", ratio[PEER_KTK],
                       dtype_name(&a), ktk_class, ktk_variant,
                       pass ? t_fb[PEER_KTK] : t_fwd[PEER_KTK]);
            printf("\n");
        }
    }
    for (int pass = 0; a.phases && pass < 2; pass++) {
        /* mean ms per call of each phase (forward phases over the forward calls, backward
         * phases over the backward calls) */
        const kt_moe_phase_times *p = &ph[pass];
        const double nf = p->forward_calls ? (double)p->forward_calls : 1.0;
        const double nb = p->backward_calls ? (double)p->backward_calls : 1.0;
        if (common->json) {
            printf("{\"bench\":\"moe_phases\",");
            print_config(&a, pass, threads);
            printf("\"pass\":\"%s\",\"ms_per_call\":{", pass ? "fwdbwd" : "fwd");
        } else {
            printf("phases %s (ms per call):", pass ? "fwd+bwd" : "fwd");
        }
        const int count = pass ? KT_MOE_PHASE_COUNT : KT_MOE_PHASE_RECOMPUTE;
        for (int k = 0; k < count; k++) {
            const double ms = (double)p->ns[k] * 1e-6 / (k < KT_MOE_PHASE_RECOMPUTE ? nf : nb);
            printf(common->json ? "%s\"%s\":%.3f" : "%s %s %.2f", k ? "," : "",
                   kt_moe_phase_name(k), ms);
        }
        printf(common->json ? "}}\n" : "\n");
    }
    if (!common->json) {
        printf("memory: experts %llu bytes held for %llu raw %s (%.3fx), backward buffer %llu, "
               "saved %llu bytes per token, per-call scratch %llu bytes (shareable across "
               "layers)\n",
               (unsigned long long)mem.weight_bytes, (unsigned long long)mem.raw_weight_bytes,
               kt_dtype_name(a.dtype), (double)mem.weight_bytes / (double)mem.raw_weight_bytes,
               (unsigned long long)mem.backward_buffer_bytes,
               (unsigned long long)mem.saved_bytes_per_token,
               (unsigned long long)mem.scratch_bytes);
        for (int k = 0; k < N_PEERS; k++)
            if (note[k][0])
                printf("note: %s\n", note[k]);
    }
    free_inputs(&in);
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
    return 0;
}
