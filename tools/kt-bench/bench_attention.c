/* kt-bench attention: the attention op against this machine's register peak and PyTorch's
 * CPU scaled_dot_product_attention, in the same run.
 *
 * libkt's side is the op itself, forward (kt_op_forward) and forward+backward (kt_op_forward
 * then kt_op_backward for dq, dk, dv) on random q, k, v and an output gradient. Beside it, on
 * the same threads: the register peak of vfmadd231ps (f32) or vdpbf16ps (bf16) measured before
 * and after the timed calls (the higher kept), and attn_torch_peer.py on the same inputs, its
 * calls alternating with libkt's one by one (moe_peer.h's protocol), through the python
 * --torch-python or KT_TORCH_PYTHON names (SDPA needs torch >= 2).
 *
 * The attention op is found by name and its attributes set by their .ktg names (scale,
 * causal, window, softcap), the interface fixed for it; a build without the op says so. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kt/kt.h>

#include "lib/ops/attrs.h"
#include "tools/common/usage.h"
#include "tools/kt-bench/bench.h"
#include "tools/kt-bench/limits.h"
#include "tools/kt-bench/moe_peer.h"

#ifndef KT_BENCH_ATTN_PEER_SCRIPT
#define KT_BENCH_ATTN_PEER_SCRIPT "tools/kt-bench/attn_torch_peer.py"
#endif

#define MAX_LIST 8

typedef struct attn_cfg {
    int64_t B, T, S, Hq, Hkv, D;
    kt_dtype dtype;
    int causal;
    int64_t window;
    double scale, softcap;
} attn_cfg;

typedef struct attn_opts {
    int64_t T[MAX_LIST], hkv[MAX_LIST], d[MAX_LIST];
    int nT, nhkv, nd;
    int64_t B, S, hq; /* S 0: S = T */
    unsigned dtypes;  /* bit 0: f32, bit 1: bf16 */
    int causal;
    int64_t window;
    double scale, softcap;
    int peer;
    const char *python, *script;
} attn_opts;

/* The tensors of one configuration: in = q, k, v; out = o, lse; go = grad o and grad lse
 * (zeros); gin = dq, dk, dv. */
typedef struct attn_bufs {
    kt_tensor in[3], out[2], go[2], gin[3];
    void *scratch;
    size_t scratch_fwd, scratch_bwd;
} attn_bufs;

static const char *const tool = "kt-bench attention";

/* ---- options ---------------------------------------------------------------------------- */

static int parse_list(const char *opt, const char *v, int64_t lo, int64_t hi, int64_t *out,
                      int *n)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        long long x;
        if (*n == MAX_LIST)
            return kt_tool_usage_error(tool, "%s: at most %d values", opt, MAX_LIST);
        if (kt_tool_parse_int(tool, opt, tok, lo, hi, &x) != 0)
            return 2;
        out[(*n)++] = x;
    }
    return *n > 0 ? 0 : kt_tool_usage_error(tool, "%s needs a value", opt);
}

static void help(void)
{
    printf(
        "usage: kt-bench attention [--T LIST] [--S N] [--B N] [--hq N] [--hkv LIST] [--d LIST]\n"
        "                          [--dtype f32|bf16|both] [--no-causal] [--window N]\n"
        "                          [--scale F] [--softcap F] [--no-peer]\n"
        "                          [--torch-python PATH] [--peer-script PATH]\n"
        "                          [--threads N] [--repeats N] [--json]\n"
        "Times the attention op (q [B,T,Hq,D], k and v [B,S,Hkv,D]) forward and\n"
        "forward+backward on random inputs; prints ms, GFLOP/s, the fraction of the\n"
        "register peak measured in the same run (vfmadd231ps for f32, vdpbf16ps for bf16;\n"
        "bf16 also against vfmadd231ps), the ratio against PyTorch's CPU\n"
        "scaled_dot_product_attention on the same inputs and threads (torch time / libkt\n"
        "time, forward and forward+backward), and the memory attention keeps for backward\n"
        "(its lse output, B*Hq*T floats) beside a T*S score matrix's.\n"
        "FLOPs: 2*B*Hq*(D+Dv)*P forward, P the visible (query, key) pairs: T*S, about\n"
        "half of it causal (T(T+1)/2 at S = T), fewer with a window; forward+backward 3.5x\n"
        "that (the backward's 5 products: q k^T again, dv, dp, dq, dk).\n"
        "Defaults: every combination of --T 1024,4096 --hkv 16,4 --d 128,64 and f32 and\n"
        "bf16, B 1, S = T, Hq 16, causal, all CPUs, 5 repeats after 1 warm-up call.\n"
        "The peer: attn_torch_peer.py run by the python --torch-python names, else the\n"
        "environment's KT_TORCH_PYTHON, else python3 from PATH; it needs torch >= 2 (Debian's\n"
        "1.13 has no SDPA). Without it the ratio is null with a note. Grouped-query\n"
        "attention goes through SDPA's enable_gqa, or, where this torch lacks it, K/V heads\n"
        "repeated before the timed calls (the note says which). The peer's output is\n"
        "checked against libkt's once (peer_max_abs_diff). A peer that does not answer in\n"
        "5 minutes (10 to start; KT_BENCH_PEER_TIMEOUT_S replaces both) is killed.\n");
}

static int parse(int argc, char **argv, attn_opts *o)
{
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long x;
        if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
            help();
            exit(0);
        }
        static const char *const with_value[] = {
            "--T",     "--S",      "--B",       "--hq",           "--hkv",         "--d",
            "--dtype", "--window", "--softcap", "--torch-python", "--peer-script", "--scale"};
        if (bench_is_one_of(s, with_value, (int)(sizeof with_value / sizeof with_value[0])) &&
            v == NULL)
            return kt_tool_usage_error(tool, "%s needs a value", s);
        if (strcmp(s, "--T") == 0) {
            if (parse_list(s, v, 1, 1 << 20, o->T, &o->nT))
                return 2;
        } else if (strcmp(s, "--hkv") == 0) {
            if (parse_list(s, v, 1, 1024, o->hkv, &o->nhkv))
                return 2;
        } else if (strcmp(s, "--d") == 0) {
            if (parse_list(s, v, 1, 1024, o->d, &o->nd))
                return 2;
        } else if (strcmp(s, "--S") == 0 || strcmp(s, "--B") == 0 || strcmp(s, "--hq") == 0 ||
                   strcmp(s, "--window") == 0) {
            const long long lo = strcmp(s, "--window") == 0 ? 0 : 1;
            if (kt_tool_parse_int(tool, s, v, lo, 1 << 20, &x) != 0)
                return 2;
            int64_t *dst = s[2] == 'S' ? &o->S : s[2] == 'B' ? &o->B : s[2] == 'h' ? &o->hq
                                                                                  : &o->window;
            *dst = x;
        } else if (strcmp(s, "--dtype") == 0) {
            if (strcmp(v, "f32") == 0)
                o->dtypes = 1u;
            else if (strcmp(v, "bf16") == 0)
                o->dtypes = 2u;
            else if (strcmp(v, "both") == 0)
                o->dtypes = 3u;
            else
                return kt_tool_usage_error(tool, "unknown dtype '%s' (f32, bf16 or both)", v);
        } else if (strcmp(s, "--scale") == 0 || strcmp(s, "--softcap") == 0) {
            char *end = NULL;
            const double f = strtod(v, &end);
            if (end == v || *end != '\0' || !(f >= 0) || !isfinite(f))
                return kt_tool_usage_error(tool, "%s needs a number >= 0, not '%s'", s, v);
            *(s[2] == 's' && s[3] == 'c' ? &o->scale : &o->softcap) = f;
        } else if (strcmp(s, "--torch-python") == 0) {
            o->python = v;
        } else if (strcmp(s, "--peer-script") == 0) {
            o->script = v;
        } else if (strcmp(s, "--no-causal") == 0) {
            o->causal = 0;
            continue;
        } else if (strcmp(s, "--no-peer") == 0) {
            o->peer = 0;
            continue;
        } else {
            return kt_tool_usage_error(tool, "unknown option %s (see --help)", s);
        }
        i++;
    }
    return 0;
}

/* ---- the op ----------------------------------------------------------------------------- */

static uint64_t rng = 0x2545F4914F6CDD1Dull;

static double normal(void)
{
    double u[2];
    for (int k = 0; k < 2; k++) {
        rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
        u[k] = (double)((rng * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
    }
    return sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]);
}

/* An attribute set by its .ktg name; 0, or 1 when the op has no such attribute. */
static int set_attr(kt_op op, kt_op_attrs *at, const char *name, double v)
{
    const kt__attr_desc *a = kt__attr_find(op, name, strlen(name));
    if (a == NULL)
        return 1;
    if (a->type == KT__ATTR_FLOAT)
        kt__attr_set_f(a, at, v);
    else
        kt__attr_set_i(a, at, (int64_t)v);
    return 0;
}

static int make_attrs(kt_op op, const attn_cfg *c, kt_op_attrs *at)
{
    *at = kt_op_defaults(op);
    const char *names[4] = {"scale", "causal", "window", "softcap"};
    const double values[4] = {c->scale, c->causal, (double)c->window, c->softcap};
    for (int k = 0; k < 4; k++)
        if (set_attr(op, at, names[k], values[k]) != 0 && values[k] != 0) {
            fprintf(stderr, "%s: the attention op has no attribute '%s'\n", tool, names[k]);
            return 1;
        }
    return 0;
}

static int alloc_tensor(kt_tensor *t, kt_dtype dtype, int ndim, const int64_t *shape)
{
    kt_tensor_init(t, NULL, dtype, ndim, shape);
    t->data = aligned_alloc(64, (kt_tensor_nbytes(t) + 63) & ~(size_t)63);
    return t->data != NULL ? 0 : -1;
}

static void fill_normal(kt_tensor *t, double sd)
{
    const int64_t n = kt_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        const float v = (float)(normal() * sd);
        if (t->dtype == KT_F32)
            ((float *)t->data)[i] = v;
        else
            ((uint16_t *)t->data)[i] = kt_f32_to_bf16_1(v);
    }
}

static void free_bufs(attn_bufs *b)
{
    for (int k = 0; k < 3; k++)
        free(b->in[k].data), free(b->gin[k].data);
    for (int k = 0; k < 2; k++)
        free(b->out[k].data), free(b->go[k].data);
    free(b->scratch);
}

static int make_bufs(kt_op op, const kt_op_attrs *at, const attn_cfg *c, attn_bufs *b)
{
    memset(b, 0, sizeof *b);
    const int64_t qs[4] = {c->B, c->T, c->Hq, c->D}, ks[4] = {c->B, c->S, c->Hkv, c->D};
    int bad = alloc_tensor(&b->in[0], c->dtype, 4, qs) | alloc_tensor(&b->in[1], c->dtype, 4, ks) |
              alloc_tensor(&b->in[2], c->dtype, 4, ks);
    for (int k = 0; k < 3 && !bad; k++)
        bad |= alloc_tensor(&b->gin[k], c->dtype, 4, b->in[k].shape);
    if (bad) {
        fprintf(stderr, "%s: out of memory\n", tool);
        return 1;
    }
    if (kt_op_infer(op, at, b->in, 3, b->out, 2) != KT_OK) {
        fprintf(stderr, "%s: %s\n", tool, kt_last_error());
        return 1;
    }
    for (int k = 0; k < 2 && !bad; k++)
        bad |= alloc_tensor(&b->out[k], b->out[k].dtype, b->out[k].ndim, b->out[k].shape);
    bad |= alloc_tensor(&b->go[0], b->out[0].dtype, b->out[0].ndim, b->out[0].shape);
    /* lse's gradient: zeros (the loss does not read lse; the op wants a tensor) */
    bad |= alloc_tensor(&b->go[1], b->out[1].dtype, b->out[1].ndim, b->out[1].shape);
    if (!bad)
        memset(b->go[1].data, 0, kt_tensor_nbytes(&b->go[1]));
    b->scratch_fwd = kt_op_scratch_bytes(op, at, b->in, 3, 0);
    b->scratch_bwd = kt_op_scratch_bytes(op, at, b->in, 3, 1);
    const size_t sc = b->scratch_fwd > b->scratch_bwd ? b->scratch_fwd : b->scratch_bwd;
    b->scratch = sc > 0 ? aligned_alloc(64, (sc + 63) & ~(size_t)63) : NULL;
    if (bad || (sc > 0 && b->scratch == NULL)) {
        fprintf(stderr, "%s: out of memory\n", tool);
        return 1;
    }
    for (int k = 0; k < 3; k++)
        fill_normal(&b->in[k], 1.0);
    fill_normal(&b->go[0], 1.0);
    return 0;
}

static kt_status run_once(kt_op op, const kt_op_attrs *at, attn_bufs *b, kt_threadpool *pool,
                          int backward)
{
    const size_t sc = b->scratch_fwd > b->scratch_bwd ? b->scratch_fwd : b->scratch_bwd;
    const kt_exec ex = {pool, b->scratch, sc};
    kt_status st = kt_op_forward(op, at, b->in, 3, b->out, 2, &ex);
    if (st == KT_OK && backward)
        st = kt_op_backward(op, at, b->in, 3, b->out, 2, b->go, b->gin, &ex);
    return st;
}

/* Visible (query, key) pairs of one head: query t at aligned position S-T+t sees keys j <=
 * that position (causal), and only those less than `window` behind it. */
static double visible_pairs(const attn_cfg *c)
{
    if (!c->causal && c->window == 0)
        return (double)c->T * (double)c->S;
    double pairs = 0;
    for (int64_t t = 0; t < c->T; t++) {
        const int64_t pos = c->S - c->T + t;
        int64_t hi = c->causal ? (pos < c->S - 1 ? pos : c->S - 1) : c->S - 1;
        int64_t lo = c->window > 0 ? pos - c->window + 1 : 0;
        lo = lo < 0 ? 0 : lo;
        pairs += hi >= lo ? (double)(hi - lo + 1) : 0.0;
    }
    return pairs;
}

static double flops(const attn_cfg *c, int backward)
{
    const double fwd = 2.0 * (double)c->B * (double)c->Hq * (double)(2 * c->D) * visible_pairs(c);
    return backward ? 3.5 * fwd : fwd;
}

/* ---- the peer --------------------------------------------------------------------------- */

static int write_peer_inputs(const attn_bufs *b, const char *path)
{
    const kt_st_item items[] = {
        {"q", b->in[0]}, {"k", b->in[1]}, {"v", b->in[2]}, {"grad_o", b->go[0]}, {"o", b->out[0]}};
    return kt_st_save(path, items, sizeof items / sizeof items[0], NULL) == KT_OK ? 0 : 1;
}

/* The string value of "key" in a JSON line into out ("" when absent). */
static void json_str(const char *line, const char *key, char *out, size_t size)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": \"", key);
    const char *p = strstr(line, pat);
    out[0] = '\0';
    if (p == NULL)
        return;
    p += strlen(pat);
    const char *e = strchr(p, '"');
    snprintf(out, size, "%.*s", e ? (int)(e - p) : 0, p);
}

static double json_num(const char *line, const char *key, double fallback)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(line, pat);
    return p ? atof(p + strlen(pat)) : fallback;
}

typedef struct peer_info {
    moe_peer *p;
    char note[400];
    char version[32], gqa[24], node[80];
    double max_abs_diff;
    int masked;
    int started; /* it loaded its inputs (its figures are printed even if it failed later) */
} peer_info;

static void start_peer(const attn_opts *o, const attn_cfg *c, const attn_bufs *b, int threads,
                       int json, peer_info *pi)
{
    memset(pi, 0, sizeof *pi);
    pi->max_abs_diff = -1.0;
    if (!o->peer) {
        snprintf(pi->note, sizeof pi->note, "peer not run (--no-peer)");
        return;
    }
    char path[256];
    snprintf(path, sizeof path, "/tmp/kt-bench-attn-%d.safetensors", (int)getpid());
    if (write_peer_inputs(b, path) != 0) {
        snprintf(pi->note, sizeof pi->note, "could not write the peer's inputs: %s",
                 kt_last_error());
        return;
    }
    char th[16], causal[4], scale[32], window[24], softcap[32], label[40], ready[4096];
    snprintf(th, sizeof th, "%d", threads);
    snprintf(causal, sizeof causal, "%d", c->causal);
    snprintf(scale, sizeof scale, "%.9g", c->scale);
    snprintf(window, sizeof window, "%lld", (long long)c->window);
    snprintf(softcap, sizeof softcap, "%.9g", c->softcap);
    const char *dt = kt_dtype_name(c->dtype);
    snprintf(label, sizeof label, "torch sdpa %s", dt);
    const char *const args[] = {o->script, path,      "--dtype",  dt,     "--threads",
                                th,        "--causal", causal,    "--scale", scale,
                                "--window", window,    "--softcap", softcap};
    if (!json)
        fprintf(stderr, "%s: starting the %s peer (%s)...\n", tool, label, o->python);
    pi->p = bench_peer_start(o->python, args, (int)(sizeof args / sizeof args[0]), label, ready,
                             sizeof ready, pi->note, sizeof pi->note);
    unlink(path); /* the peer has read it */
    if (pi->p == NULL)
        return;
    pi->started = 1;
    json_str(ready, "torch_version", pi->version, sizeof pi->version);
    json_str(ready, "gqa", pi->gqa, sizeof pi->gqa);
    json_str(ready, "backward_node", pi->node, sizeof pi->node);
    pi->max_abs_diff = json_num(ready, "max_abs_diff", -1.0);
    pi->masked = strstr(ready, "\"mask\": true") != NULL;
    if (strcmp(pi->gqa, "repeat_interleave") == 0)
        snprintf(pi->note, sizeof pi->note,
                 "torch %s has no enable_gqa: its K/V heads repeated (repeat_interleave) "
                 "before the timed calls",
                 pi->version);
    /* a peer computing something else would make the ratio meaningless: say so */
    const double tol = c->dtype == KT_F32 ? 1e-3 : 6e-2;
    if (!(pi->max_abs_diff >= 0 && pi->max_abs_diff <= tol)) {
        const size_t n = strlen(pi->note);
        snprintf(pi->note + n, sizeof pi->note - n,
                 "%storch's output differs from libkt's by %.3g (max |diff|)", n ? "; " : "",
                 pi->max_abs_diff);
    }
}

/* ---- timing ----------------------------------------------------------------------------- */

/* The median seconds of libkt's calls (-1 on failure) and, in *peer_ms, of the peer's calls
 * made between them (-1 when it failed) */
static double time_pass(kt_op op, const kt_op_attrs *at, attn_bufs *b, kt_threadpool *pool,
                        int backward, int warmup, int repeats, peer_info *pi, double *peer_ms)
{
    const int total = warmup + repeats;
    double *t = calloc((size_t)total, sizeof *t), *pt = calloc((size_t)total, sizeof *pt);
    *peer_ms = -1.0;
    if (t == NULL || pt == NULL) {
        free(t), free(pt);
        return -1.0;
    }
    for (int r = 0; r < total; r++) {
        const double t0 = bench_now_s();
        if (run_once(op, at, b, pool, backward) != KT_OK) {
            fprintf(stderr, "%s: %s\n", tool, kt_last_error());
            free(t), free(pt);
            return -1.0;
        }
        t[r] = bench_now_s() - t0;
        if (!moe_peer_failed(pi->p)) {
            moe_peer_gap();
            pt[r] = moe_peer_call(pi->p, backward, r, pi->note, sizeof pi->note);
            moe_peer_gap();
        }
    }
    int ok = !moe_peer_failed(pi->p);
    for (int r = 0; ok && r < total; r++)
        ok = pt[r] > 0;
    if (ok)
        *peer_ms = bench_median(pt + warmup, repeats);
    const double med = bench_median(t + warmup, repeats);
    free(t), free(pt);
    return med;
}

/* ---- one configuration ------------------------------------------------------------------ */

typedef struct peaks {
    double main, fma; /* fraction_of_peak's (FMA for f32, vdpbf16ps for bf16); FMA's */
} peaks;

static void measure_peaks(const attn_cfg *c, kt_threadpool *pool, peaks *pk)
{
    const int threads = kt_threadpool_size(pool);
    const double fma = bench_insn_peak_gflops(KT__KINSN_FMA, bench_fma_bits(), pool, threads, 5);
    const double dp =
        c->dtype == KT_BF16 ? bench_insn_peak_gflops(KT__KINSN_DPBF16, 512, pool, threads, 5) : 0.0;
    const double main_peak = c->dtype == KT_BF16 ? dp : fma;
    pk->main = main_peak > pk->main ? main_peak : pk->main;
    pk->fma = fma > pk->fma ? fma : pk->fma;
}

static void print_config(const attn_cfg *c, int threads, int pass)
{
    printf("\"config\":{\"B\":%lld,\"T\":%lld,\"S\":%lld,\"Hq\":%lld,\"Hkv\":%lld,\"D\":%lld,"
           "\"dtype\":\"%s\",\"causal\":%s,\"window\":%lld,\"softcap\":%g,\"threads\":%d,"
           "\"pass\":\"%s\"},",
           (long long)c->B, (long long)c->T, (long long)c->S, (long long)c->Hq,
           (long long)c->Hkv, (long long)c->D, kt_dtype_name(c->dtype),
           c->causal ? "true" : "false", (long long)c->window, c->softcap, threads,
           pass ? "fwdbwd" : "fwd");
}

/* "64.0 KiB", "1.5 GiB": bytes in the unit that keeps the figure readable */
static const char *human(double bytes, char *buf, size_t size)
{
    static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4)
        bytes /= 1024.0, u++;
    snprintf(buf, size, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
    return buf;
}

static void report(const attn_cfg *c, const attn_bufs *b, int threads, int json,
                   const double t[2], const double pms[2], const peaks *pk, const peer_info *pi)
{
    const double lse_bytes = (double)kt_tensor_nbytes(&b->out[1]);
    const double score_bytes = (double)c->B * (double)c->Hq * (double)c->T * (double)c->S * 4.0;
    const char *peak_insn = c->dtype == KT_BF16 ? "vdpbf16ps" : "vfmadd231ps";
    for (int pass = 0; pass < 2; pass++) {
        const double gf = flops(c, pass) / t[pass] * 1e-9;
        const int have = pms[pass] > 0;
        const double ratio = have ? pms[pass] * 1e-3 / t[pass] : 0.0;
        if (json) {
            printf("{\"bench\":\"attention\",");
            print_config(c, threads, pass);
            /* %g: a tiny shape's figures under load must not print as 0 */
            printf("\"%s_ms\":%.4g,\"gflops\":%.4g,\"flops\":%.6g,\"peak_insn\":\"%s\","
                   "\"peak_gflops\":%.2f,",
                   pass ? "fwdbwd" : "fwd", t[pass] * 1e3, gf, flops(c, pass), peak_insn,
                   pk->main);
            if (pk->main > 0)
                printf("\"fraction_of_peak\":%.4g,", gf / pk->main);
            else
                printf("\"fraction_of_peak\":null,");
            if (c->dtype == KT_BF16 && pk->fma > 0)
                printf("\"fma_peak_gflops\":%.2f,\"fraction_of_fma_peak\":%.4g,", pk->fma,
                       gf / pk->fma);
            if (have)
                printf("\"torch_ms\":%.4g,\"ratio_vs_torch_sdpa\":%.4g,", pms[pass], ratio);
            else
                printf("\"torch_ms\":null,\"ratio_vs_torch_sdpa\":null,");
            if (pi->started)
                printf("\"torch_version\":\"%s\",\"torch_gqa\":\"%s\",\"torch_masked\":%s,"
                       "\"torch_backward_node\":\"%s\",\"peer_max_abs_diff\":%.3g,",
                       pi->version, pi->gqa, pi->masked ? "true" : "false", pi->node,
                       pi->max_abs_diff);
            printf("\"lse_bytes\":%.0f,\"score_matrix_bytes\":%.0f,\"scratch_bytes\":%zu",
                   lse_bytes, score_bytes, pass ? b->scratch_bwd : b->scratch_fwd);
            if (pi->note[0]) {
                printf(",\"note\":\"");
                bench_print_json_text(pi->note);
                printf("\"");
            }
            printf("}\n");
        } else {
            printf("attention B=%lld T=%lld S=%lld Hq=%lld Hkv=%lld D=%lld %s%s %s: %.3f ms, "
                   "%.1f GFLOP/s, %.3f of the %s peak (%.1f GFLOP/s)",
                   (long long)c->B, (long long)c->T, (long long)c->S, (long long)c->Hq,
                   (long long)c->Hkv, (long long)c->D, kt_dtype_name(c->dtype),
                   c->causal ? " causal" : "", pass ? "fwd+bwd" : "fwd", t[pass] * 1e3, gf,
                   pk->main > 0 ? gf / pk->main : 0.0, peak_insn, pk->main);
            if (c->dtype == KT_BF16 && pk->fma > 0)
                printf(", %.3f of vfmadd231ps's (%.1f)", gf / pk->fma, pk->fma);
            if (have)
                printf(", %.2fx torch sdpa (%.3f ms)", ratio, pms[pass]);
            printf("\n");
        }
    }
    if (!json) {
        char h[4][32];
        printf("  memory kept for backward: lse %s (B*Hq*T f32), against %s for the T*S score "
               "matrices (B*Hq*T*S f32); scratch fwd %s, bwd %s\n",
               human(lse_bytes, h[0], sizeof h[0]), human(score_bytes, h[1], sizeof h[1]),
               human((double)b->scratch_fwd, h[2], sizeof h[2]),
               human((double)b->scratch_bwd, h[3], sizeof h[3]));
        if (pi->started)
            printf("  torch %s, gqa %s%s, backward node %s, max |o_torch - o_libkt| %.3g\n",
                   pi->version, pi->gqa, pi->masked ? ", boolean mask" : "", pi->node,
                   pi->max_abs_diff);
        if (pi->note[0])
            printf("  note: %s\n", pi->note);
    }
    fflush(stdout);
}

static int run_config(kt_op op, const attn_opts *o, const attn_cfg *c, kt_threadpool *pool,
                      const bench_args *common, int warmup, int repeats)
{
    const int threads = kt_threadpool_size(pool);
    kt_op_attrs at;
    attn_bufs b;
    if (make_attrs(op, c, &at) != 0)
        return 1;
    if (make_bufs(op, &at, c, &b) != 0) {
        free_bufs(&b);
        return 1;
    }
    if (!common->json)
        fprintf(stderr, "%s: T=%lld S=%lld Hq=%lld Hkv=%lld D=%lld %s, %d threads: "
                        "measuring...\n",
                tool, (long long)c->T, (long long)c->S, (long long)c->Hq, (long long)c->Hkv,
                (long long)c->D, kt_dtype_name(c->dtype), threads);
    /* one forward first: the output the peer checks its own against */
    if (run_once(op, &at, &b, pool, 0) != KT_OK) {
        fprintf(stderr, "%s: %s\n", tool, kt_last_error());
        free_bufs(&b);
        return 1;
    }
    peer_info pi;
    start_peer(o, c, &b, threads, common->json, &pi);
    peaks pk = {0, 0};
    measure_peaks(c, pool, &pk);
    double t[2], pms[2];
    t[0] = time_pass(op, &at, &b, pool, 0, warmup, repeats, &pi, &pms[0]);
    t[1] = t[0] > 0 ? time_pass(op, &at, &b, pool, 1, warmup, repeats, &pi, &pms[1]) : -1.0;
    moe_peer_stop(pi.p);
    pi.p = NULL;
    /* the peak again after the timed calls: one measured while something else ran on this
     * shared machine would flatter every fraction */
    measure_peaks(c, pool, &pk);
    const int rc = t[0] > 0 && t[1] > 0 ? 0 : 1;
    if (rc == 0)
        report(c, &b, threads, common->json, t, pms, &pk, &pi);
    free_bufs(&b);
    return rc;
}

int bench_attention(int argc, char **argv, const bench_args *common)
{
    static char found[4096];
    const char *env_python = getenv("KT_TORCH_PYTHON");
    attn_opts o = {.T = {1024, 4096},
                   .nT = 2,
                   .hkv = {16, 4},
                   .nhkv = 2,
                   .d = {128, 64},
                   .nd = 2,
                   .B = 1,
                   .hq = 16,
                   .dtypes = 3u,
                   .causal = 1,
                   .peer = 1,
                   .python = env_python && env_python[0] ? env_python : "python3",
                   .script = bench_find_script(KT_BENCH_ATTN_PEER_SCRIPT, "attn_torch_peer.py",
                                               found, sizeof found)};
    int rc = parse(argc, argv, &o);
    if (rc != 0)
        return rc;
    for (int i = 0; i < o.nhkv; i++)
        if (o.hq % o.hkv[i] != 0)
            return kt_tool_usage_error(tool, "--hkv %lld does not divide --hq %lld",
                                       (long long)o.hkv[i], (long long)o.hq);
    kt_op op;
    if (kt_op_from_name("attention", &op) != KT_OK) {
        fprintf(stderr, "%s: this libkt has no attention op\n", tool);
        return 1;
    }
    const int threads = common->threads_given ? common->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    kt_threadpool *pool;
    if (kt_threadpool_create(threads, &pool) != KT_OK) {
        fprintf(stderr, "%s: %s\n", tool, kt_last_error());
        return 1;
    }
    const int repeats = common->repeats_given ? common->repeats : 5;
    const int warmup = 1;
    for (int di = 0; di < 2 && rc == 0; di++) {
        if (!(o.dtypes & (1u << di)))
            continue;
        for (int d = 0; d < o.nd && rc == 0; d++)
            for (int h = 0; h < o.nhkv && rc == 0; h++)
                for (int ti = 0; ti < o.nT && rc == 0; ti++) {
                    const attn_cfg c = {.B = o.B,
                                        .T = o.T[ti],
                                        .S = o.S > 0 ? o.S : o.T[ti],
                                        .Hq = o.hq,
                                        .Hkv = o.hkv[h],
                                        .D = o.d[d],
                                        .dtype = di ? KT_BF16 : KT_F32,
                                        .causal = o.causal,
                                        .window = o.window,
                                        .scale = o.scale,
                                        .softcap = o.softcap};
                    rc = run_config(op, &o, &c, pool, common, warmup, repeats);
                }
    }
    kt_threadpool_destroy(pool);
    return rc;
}
