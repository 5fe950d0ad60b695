/* Two-layer MoE transformers written in .ktg, compiled and run through a session, against the
 * same models written here in float64, independently of libkt's kernels: a Qwen3-MoE-style
 * model (per-head q/k RMSNorm before rotate-half RoPE, GQA causal attention, a softmax top-k
 * router over CPU experts) and a DeepSeek-V2-style one (multi-head latent attention with the
 * nope/rope split and interleaved RoPE on a shared key head, Dv != D, a dense MLP layer, then
 * group-limited routing with a routed scaling factor beside a shared expert).
 *
 * For each: the loss equals the float64 loss, every parameter's gradient (the graph's and the
 * experts') equals central finite differences of the float64 model, and a few optimizer steps
 * make the loss fall. The parameters carry Hugging Face's names. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

enum { T = 8, V = 13, H = 16, L = 2, MAX_PARAMS = 96 };

/* ---- the models' sizes and the router each uses -------------------------------------------- */

typedef struct spec {
    const char *name; /* tests/models/<name>.ktg */
    int deepseek;
    /* attention: GQA (Qwen3) or MLA (DeepSeek) */
    int nh, nkv, d;              /* Qwen3: heads, KV heads, head_dim */
    int q_lora, kv_lora, dn, dr, dv; /* DeepSeek MLA */
    double theta;
    /* MoE */
    int e, k, inter;
    int n_group, topk_group; /* 0: plain top-k */
    int norm_topk;
    double routed_scale;
    int shared_inter;     /* DeepSeek: the shared expert's width */
    int dense_inter;      /* DeepSeek: the dense first layer's MLP width */
    int first_dense;      /* layers below this are dense */
} spec;

/* ---- float64 parameters: the session's values, copied, addressed by name ------------------- */

typedef struct ref_model {
    int n;
    char name[MAX_PARAMS][112];
    double *val[MAX_PARAMS];
    int64_t len[MAX_PARAMS];
    double *kt_grad[MAX_PARAMS]; /* the session's gradient, widened */
} ref_model;

static double *param(const ref_model *m, const char *fmt, ...)
{
    char name[112];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->name[i], name) == 0)
            return m->val[i];
    fail_msg("no parameter '%s'", name);
    return NULL;
}

static void add_entry(ref_model *m, const char *name, const kt_tensor *value,
                      const kt_tensor *grad)
{
    assert_true(m->n < MAX_PARAMS);
    int i = m->n++;
    snprintf(m->name[i], sizeof m->name[i], "%s", name);
    int64_t n = kt_tensor_numel(value);
    m->len[i] = n;
    m->val[i] = malloc((size_t)n * sizeof(double));
    m->kt_grad[i] = malloc((size_t)n * sizeof(double));
    for (int64_t j = 0; j < n; j++) {
        m->val[i][j] = tu_get(value, j);
        m->kt_grad[i][j] = tu_get(grad, j);
    }
}

static void ref_free(ref_model *m)
{
    for (int i = 0; i < m->n; i++) {
        free(m->val[i]);
        free(m->kt_grad[i]);
    }
}

/* ---- float64 building blocks ----------------------------------------------------------------- */

/* y [m, n] = x [m, k] w^T + bias, w [n, k] (nn.Linear's layout) */
static void linear(const double *x, int64_t m, int64_t k, const double *w, int64_t n, double *y)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t c = 0; c < k; c++)
                s += x[i * k + c] * w[j * k + c];
            y[i * n + j] = s;
        }
}

/* rows of n values, each at `stride` from the last */
static void rmsnorm(const double *x, int64_t rows, int64_t n, int64_t stride, const double *w,
                    double eps, double *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * stride;
        double ss = 0;
        for (int64_t j = 0; j < n; j++)
            ss += xr[j] * xr[j];
        double inv = 1.0 / sqrt(ss / (double)n + eps);
        for (int64_t j = 0; j < n; j++)
            y[r * n + j] = xr[j] * inv * w[j];
    }
}

/* Rotates `rot` values of each of the `heads` heads of every token, starting `off` into the
 * head, `width` apart; position = token index. Rotate-half pairs j and j + rot/2, interleaved
 * pairs 2j and 2j + 1 (and leaves them interleaved). */
static void rope(double *x, int64_t heads, int64_t width, int64_t off, int64_t rot,
                 int interleaved, double theta)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            double *v = x + (t * heads + h) * width + off;
            for (int64_t j = 0; j < rot / 2; j++) {
                double ang = (double)t * pow(theta, -2.0 * (double)j / (double)rot);
                int64_t a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + rot / 2;
                double x0 = v[a], x1 = v[b];
                v[a] = x0 * cos(ang) - x1 * sin(ang);
                v[b] = x1 * cos(ang) + x0 * sin(ang);
            }
        }
}

/* Causal attention, q [T, nh, d], k [T, nkv, d], v [T, nkv, dv] -> o [T, nh, dv]. */
static void attention(const double *q, const double *k, const double *v, int nh, int nkv, int d,
                      int dv, double *o)
{
    double p[T];
    for (int h = 0; h < nh; h++) {
        int kh = h / (nh / nkv);
        for (int i = 0; i < T; i++) {
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= i; j++) {
                double s = 0;
                for (int c = 0; c < d; c++)
                    s += q[(i * nh + h) * d + c] * k[(j * nkv + kh) * d + c];
                p[j] = s / sqrt((double)d);
                mx = fmax(mx, p[j]);
            }
            for (int j = 0; j <= i; j++)
                sum += (p[j] = exp(p[j] - mx));
            for (int c = 0; c < dv; c++) {
                double acc = 0;
                for (int j = 0; j <= i; j++)
                    acc += p[j] / sum * v[(j * nkv + kh) * dv + c];
                o[(i * nh + h) * dv + c] = acc;
            }
        }
    }
}

static double silu(double x) { return x / (1.0 + exp(-x)); }

/* y += scale * down(silu(gate x) * up x) for one token; gate/up [inter, H], down [H, inter] */
static void swiglu_add(const double *x, const double *gate, const double *up, const double *down,
                       int inter, double scale, double *y)
{
    double a[64];
    assert_true(inter <= 64);
    for (int i = 0; i < inter; i++) {
        double g = 0, u = 0;
        for (int c = 0; c < H; c++) {
            g += gate[i * H + c] * x[c];
            u += up[i * H + c] * x[c];
        }
        a[i] = silu(g) * u;
    }
    for (int c = 0; c < H; c++) {
        double s = 0;
        for (int i = 0; i < inter; i++)
            s += down[c * inter + i] * a[i];
        y[c] += scale * s;
    }
}

/* Softmax, then (group-limited) top-k in descending order, lower expert first on ties; weights
 * renormalised when asked, then scaled. */
static void route(const spec *sp, const double *logits, int *ids, double *w)
{
    double p[64], masked[64];
    int e = sp->e;
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < e; j++)
        mx = fmax(mx, logits[j]);
    for (int j = 0; j < e; j++)
        sum += (p[j] = exp(logits[j] - mx));
    for (int j = 0; j < e; j++)
        masked[j] = p[j] /= sum;
    if (sp->n_group > 0) {
        int per = e / sp->n_group, keep[16] = {0};
        double score[16];
        for (int g = 0; g < sp->n_group; g++) {
            score[g] = -INFINITY;
            for (int j = 0; j < per; j++)
                score[g] = fmax(score[g], p[g * per + j]);
        }
        for (int r = 0; r < sp->topk_group; r++) {
            int best = -1;
            for (int g = 0; g < sp->n_group; g++)
                if (!keep[g] && (best < 0 || score[g] > score[best]))
                    best = g;
            keep[best] = 1;
        }
        for (int j = 0; j < e; j++)
            if (!keep[j / per])
                masked[j] = 0;
    }
    double total = 0;
    for (int r = 0; r < sp->k; r++) {
        int best = -1;
        for (int j = 0; j < e; j++) {
            int taken = 0;
            for (int q = 0; q < r; q++)
                taken |= ids[q] == j;
            if (!taken && (best < 0 || masked[j] > masked[best]))
                best = j;
        }
        ids[r] = best;
        total += w[r] = p[best];
    }
    for (int r = 0; r < sp->k; r++)
        w[r] = (sp->norm_topk ? w[r] / total : w[r]) * sp->routed_scale;
}

/* ---- the two models in float64 ------------------------------------------------------------- */

static void qwen3_attention(const spec *sp, const ref_model *m, int l, const double *a, double *o)
{
    int nh = sp->nh, nkv = sp->nkv, d = sp->d;
    double q[T * 64], k[T * 64], v[T * 64], t[T * 64];
    linear(a, T, H, param(m, "model.layers.%d.self_attn.q_proj.weight", l), nh * d, t);
    rmsnorm(t, T * nh, d, d, param(m, "model.layers.%d.self_attn.q_norm.weight", l), 1e-6, q);
    linear(a, T, H, param(m, "model.layers.%d.self_attn.k_proj.weight", l), nkv * d, t);
    rmsnorm(t, T * nkv, d, d, param(m, "model.layers.%d.self_attn.k_norm.weight", l), 1e-6, k);
    linear(a, T, H, param(m, "model.layers.%d.self_attn.v_proj.weight", l), nkv * d, v);
    rope(q, nh, d, 0, d, 0, sp->theta);
    rope(k, nkv, d, 0, d, 0, sp->theta);
    attention(q, k, v, nh, nkv, d, d, t);
    linear(t, T, nh * d, param(m, "model.layers.%d.self_attn.o_proj.weight", l), H, o);
}

static void mla_attention(const spec *sp, const ref_model *m, int l, const double *a, double *o)
{
    int nh = sp->nh, dn = sp->dn, dr = sp->dr, dv = sp->dv, dq = dn + dr;
    double qa[T * 64], qn[T * 64], q[T * 128], ckv[T * 64], c[T * 64], kv[T * 128];
    double k[T * 128], v[T * 128], att[T * 128];
    linear(a, T, H, param(m, "model.layers.%d.self_attn.q_a_proj.weight", l), sp->q_lora, qa);
    rmsnorm(qa, T, sp->q_lora, sp->q_lora,
            param(m, "model.layers.%d.self_attn.q_a_layernorm.weight", l), 1e-6, qn);
    linear(qn, T, sp->q_lora, param(m, "model.layers.%d.self_attn.q_b_proj.weight", l), nh * dq,
           q);
    rope(q, nh, dq, dn, dr, 1, sp->theta);
    int kvw = sp->kv_lora + dr;
    linear(a, T, H, param(m, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l), kvw, ckv);
    rmsnorm(ckv, T, sp->kv_lora, kvw,
            param(m, "model.layers.%d.self_attn.kv_a_layernorm.weight", l), 1e-6, c);
    rope(ckv, 1, kvw, sp->kv_lora, dr, 1, sp->theta); /* the shared key head's rope part */
    linear(c, T, sp->kv_lora, param(m, "model.layers.%d.self_attn.kv_b_proj.weight", l),
           nh * (dn + dv), kv);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            const double *src = kv + (t * nh + h) * (dn + dv);
            for (int j = 0; j < dn; j++)
                k[(t * nh + h) * dq + j] = src[j];
            for (int j = 0; j < dr; j++)
                k[(t * nh + h) * dq + dn + j] = ckv[t * kvw + sp->kv_lora + j];
            for (int j = 0; j < dv; j++)
                v[(t * nh + h) * dv + j] = src[dn + j];
        }
    attention(q, k, v, nh, nh, dq, dv, att);
    linear(att, T, nh * dv, param(m, "model.layers.%d.self_attn.o_proj.weight", l), H, o);
}

static void ffn(const spec *sp, const ref_model *m, int l, const double *n, double *y)
{
    memset(y, 0, sizeof(double) * T * H);
    if (l < sp->first_dense) {
        for (int t = 0; t < T; t++)
            swiglu_add(n + t * H, param(m, "model.layers.%d.mlp.gate_proj.weight", l),
                       param(m, "model.layers.%d.mlp.up_proj.weight", l),
                       param(m, "model.layers.%d.mlp.down_proj.weight", l), sp->dense_inter, 1,
                       y + t * H);
        return;
    }
    double logits[T * 64];
    linear(n, T, H, param(m, "model.layers.%d.mlp.gate.weight", l), sp->e, logits);
    for (int t = 0; t < T; t++) {
        int ids[16];
        double w[16];
        route(sp, logits + t * sp->e, ids, w);
        for (int r = 0; r < sp->k; r++)
            swiglu_add(n + t * H, param(m, "model.layers.%d.mlp.experts.%d.gate_proj.weight", l, ids[r]),
                       param(m, "model.layers.%d.mlp.experts.%d.up_proj.weight", l, ids[r]),
                       param(m, "model.layers.%d.mlp.experts.%d.down_proj.weight", l, ids[r]),
                       sp->inter, w[r], y + t * H);
        if (sp->shared_inter > 0)
            swiglu_add(n + t * H, param(m, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l),
                       param(m, "model.layers.%d.mlp.shared_experts.up_proj.weight", l),
                       param(m, "model.layers.%d.mlp.shared_experts.down_proj.weight", l),
                       sp->shared_inter, 1, y + t * H);
    }
}

static double ref_loss(const spec *sp, const ref_model *m, const int *tokens, const int *targets)
{
    double h[T * H], a[T * H], o[T * H], logits[T * V];
    const double *emb = param(m, "model.embed_tokens.weight");
    for (int t = 0; t < T; t++)
        memcpy(h + t * H, emb + tokens[t] * H, sizeof(double) * H);
    for (int l = 0; l < L; l++) {
        rmsnorm(h, T, H, H, param(m, "model.layers.%d.input_layernorm.weight", l), 1e-6, a);
        (sp->deepseek ? mla_attention : qwen3_attention)(sp, m, l, a, o);
        for (int i = 0; i < T * H; i++)
            h[i] += o[i];
        rmsnorm(h, T, H, H, param(m, "model.layers.%d.post_attention_layernorm.weight", l), 1e-6,
                a);
        ffn(sp, m, l, a, o);
        for (int i = 0; i < T * H; i++)
            h[i] += o[i];
    }
    rmsnorm(h, T, H, H, param(m, "model.norm.weight"), 1e-6, a);
    linear(a, T, H, param(m, "lm_head.weight"), V, logits);
    double loss = 0;
    for (int t = 0; t < T; t++) {
        const double *r = logits + t * V;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < V; j++)
            mx = fmax(mx, r[j]);
        for (int j = 0; j < V; j++)
            sum += exp(r[j] - mx);
        loss += mx + log(sum) - r[targets[t]];
    }
    return loss / T;
}

/* ---- the models in .ktg ---------------------------------------------------------------------- */

/* tests/models/<name>.ktg: the sizes there are the ones below */
static const spec qwen3 = {.name = "qwen3_moe", .nh = 4, .nkv = 2, .d = 4,
                           .theta = 10000, .e = 4, .k = 2, .inter = 6, .routed_scale = 1};
static const spec deepseek = {.name = "deepseek_v2", .deepseek = 1,
                              .nh = 2, .q_lora = 8, .kv_lora = 6, .dn = 4, .dr = 4, .dv = 3,
                              .theta = 10000, .e = 4, .k = 2, .inter = 5, .n_group = 2,
                              .topk_group = 1, .routed_scale = 1.5, .shared_inter = 4,
                              .dense_inter = 7, .first_dense = 1};

/* ---- running it through libkt ---------------------------------------------------------------- */

typedef struct run {
    kt_program *p;
    kt_session *s;
    kt_moe *moe[L];
    int n_moe;
    int tokens[T], targets[T];
} run;

static char *read_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        fail_msg("cannot open %s", path);
    static char buf[1 << 16];
    *len = fread(buf, 1, sizeof buf - 1, f);
    assert_true(feof(f));
    fclose(f);
    buf[*len] = '\0';
    return buf;
}

static void start(const spec *sp, run *r, float lr)
{
    memset(r, 0, sizeof *r);
    char path[512], diag[4096];
    snprintf(path, sizeof path, "%s/tests/models/%s.ktg", KT_SOURCE_DIR, sp->name);
    size_t len;
    const char *text = read_text(path, &len);
    kt_graph *g;
    kt_status st = kt_ktg_parse(text, len, path, NULL, 0, &g, diag, sizeof diag, NULL);
    if (st != KT_OK)
        fail_msg("%s", diag);
    OK(kt_compile(g, NULL, &r->p));
    kt_graph_destroy(g);
    tu_rng rng;
    tu_rng_seed(&rng, 29);
    for (int l = sp->first_dense; l < L; l++) {
        kt_moe_config c = {.n_experts = sp->e, .hidden = H, .intermediate = sp->inter,
                           .top_k = sp->k, .max_tokens = T, .weight_dtype = KT_F32,
                           .act_dtype = KT_F32, .mode = KT_MOE_FULL, .keep_activations = 1,
                           .numa_node = -1};
        kt_moe *layer;
        OK(kt_moe_create(&c, NULL, &layer));
        for (int e = 0; e < sp->e; e++)
            for (int p = 0; p < 3; p++) {
                kt_tensor w;
                OK(kt_moe_weight(layer, e, (kt_moe_proj)p, &w));
                tu_fill_uniform(&w, &rng, -0.5, 0.5);
            }
        r->moe[r->n_moe++] = layer;
    }
    kt_session_options so = {.threads = 2, .seed = 5, .moe_layers = r->moe,
                             .n_moe_layers = r->n_moe};
    so.optimizer.kind = KT_OPTIM_ADAMW;
    so.optimizer.lr = lr;
    OK(kt_session_create(r->p, &so, &r->s));
    /* every parameter away from its initialiser (norm weights off one), so each one's
     * gradient is exercised */
    for (int i = 0; i < kt_program_count(r->p, KT_ROLE_PARAM); i++) {
        const char *name;
        OK(kt_program_tensor_info(r->p, KT_ROLE_PARAM, i, &name, NULL));
        kt_tensor w;
        OK(kt_session_tensor(r->s, KT_ROLE_PARAM, name, &w));
        int norm = strstr(name, "norm") != NULL;
        tu_fill_uniform(&w, &rng, norm ? 0.6 : -0.5, norm ? 1.4 : 0.5);
    }
    for (int t = 0; t < T; t++) {
        r->tokens[t] = (int)(tu_rng_next(&rng) % V);
        r->targets[t] = (int)(tu_rng_next(&rng) % V);
    }
    kt_tensor tok, tgt;
    OK(kt_session_tensor(r->s, KT_ROLE_INPUT, "tokens", &tok));
    OK(kt_session_tensor(r->s, KT_ROLE_INPUT, "targets", &tgt));
    for (int t = 0; t < T; t++) {
        tu_set(&tok, t, r->tokens[t]);
        tu_set(&tgt, t, r->targets[t]);
    }
}

static void finish(run *r)
{
    kt_session_destroy(r->s);
    kt_program_destroy(r->p);
    for (int l = 0; l < r->n_moe; l++)
        kt_moe_destroy(r->moe[l]);
}

/* The session's parameters and experts with their gradients, in float64. */
static void collect(const spec *sp, run *r, ref_model *m)
{
    memset(m, 0, sizeof *m);
    for (int i = 0; i < kt_program_count(r->p, KT_ROLE_PARAM); i++) {
        const char *name;
        OK(kt_program_tensor_info(r->p, KT_ROLE_PARAM, i, &name, NULL));
        kt_tensor w, gw;
        OK(kt_session_tensor(r->s, KT_ROLE_PARAM, name, &w));
        OK(kt_session_tensor(r->s, KT_ROLE_GRAD, name, &gw));
        add_entry(m, name, &w, &gw);
    }
    static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int l = sp->first_dense; l < L; l++)
        for (int e = 0; e < sp->e; e++)
            for (int p = 0; p < 3; p++) {
                kt_tensor w, gw;
                kt_moe *layer = r->moe[l - sp->first_dense];
                OK(kt_moe_weight(layer, e, (kt_moe_proj)p, &w));
                OK(kt_moe_weight_grad(layer, e, (kt_moe_proj)p, &gw));
                char name[112];
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e,
                         proj[p]);
                add_entry(m, name, &w, &gw);
            }
}

/* The loss and every gradient against the float64 model: its value, and central differences
 * of it in each of (up to) 24 seeded elements of every parameter. */
static void check_model(const spec *sp)
{
    run r;
    start(sp, &r, 1e-2f);
    OK(kt_session_forward(r.s));
    OK(kt_session_backward(r.s));
    ref_model m;
    collect(sp, &r, &m);
    double want = ref_loss(sp, &m, r.tokens, r.targets);
    double got = kt_session_loss(r.s);
    if (fabs(got - want) > 1e-5 * fabs(want))
        fail_msg("%s: loss %.9g, float64 %.9g", sp->name, got, want);

    tu_rng rng;
    tu_rng_seed(&rng, 31);
    int checked = 0;
    for (int i = 0; i < m.n; i++) {
        int64_t n = m.len[i];
        int samples = n < 24 ? (int)n : 24;
        double scale = 0, worst = 0;
        int64_t worst_at = 0;
        double fd[24], kt[24];
        int64_t at[24];
        for (int s = 0; s < samples; s++) {
            at[s] = n <= 24 ? s : (int64_t)(tu_rng_next(&rng) % (uint64_t)n);
            double *x = &m.val[i][at[s]], x0 = *x, h = 1e-5;
            *x = x0 + h;
            double up = ref_loss(sp, &m, r.tokens, r.targets);
            *x = x0 - h;
            double down = ref_loss(sp, &m, r.tokens, r.targets);
            *x = x0;
            fd[s] = (up - down) / (2 * h);
            kt[s] = m.kt_grad[i][at[s]];
            scale = fmax(scale, fabs(fd[s]));
        }
        for (int s = 0; s < samples; s++) {
            double err = fabs(kt[s] - fd[s]);
            if (err > worst)
                worst = err, worst_at = s;
        }
        if (worst > 2e-3 * fmax(scale, 1e-3))
            fail_msg("%s: %s: gradient element %lld is %.7g, float64 finite differences %.7g "
                     "(largest |gradient| sampled %.3g)",
                     sp->name, m.name[i], (long long)at[worst_at], kt[worst_at], fd[worst_at],
                     scale);
        checked += samples;
    }
    printf("%s: loss %.6f (float64 %.6f); %d gradient elements of %d tensors match float64 "
           "finite differences\n", sp->name, got, want, checked, m.n);
    ref_free(&m);
    finish(&r);
}

/* AdamW on one batch: the loss falls. */
static void check_trains(const spec *sp)
{
    run r;
    start(sp, &r, 2e-2f);
    float first = 0, last = 0;
    for (int step = 0; step < 30; step++) {
        OK(kt_session_forward(r.s));
        OK(kt_session_backward(r.s));
        OK(kt_session_step(r.s));
        last = kt_session_loss(r.s);
        if (step == 0)
            first = last;
    }
    printf("%s: loss %.4f -> %.4f in 30 AdamW steps\n", sp->name, first, last);
    if (!(last < 0.5f * first))
        fail_msg("%s: the loss fell only from %.4f to %.4f in 30 steps", sp->name, first, last);
    finish(&r);
}

static void test_qwen3_moe_matches_float64(void **state) { (void)state; check_model(&qwen3); }
static void test_qwen3_moe_trains(void **state) { (void)state; check_trains(&qwen3); }
static void test_deepseek_v2_matches_float64(void **state) { (void)state; check_model(&deepseek); }
static void test_deepseek_v2_trains(void **state) { (void)state; check_trains(&deepseek); }

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3_moe_matches_float64),
        cmocka_unit_test(test_qwen3_moe_trains),
        cmocka_unit_test(test_deepseek_v2_matches_float64),
        cmocka_unit_test(test_deepseek_v2_trains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
