/* kt-bench train: training a model with libkt against training it with PyTorch (transformers'
 * Qwen3MoeForCausalLM, PEFT for LoRA), the same model, batch and optimizer (AdamW), in the
 * same run on the same threads: tokens/s of each and their ratio, the peak RSS of each.
 *
 *   main  the main job's model (examples/moe_lm.ktg; before it exists, examples/qwen3_moe.ktg
 *         at its sizes), its sizes read from the compiled program, every parameter trained
 *         in f32 (the experts in the MoE layers' full mode)
 *   lora  a Qwen3-MoE of Qwen3-30B-A3B's layer size, written as a Hugging Face checkpoint
 *         with random bf16 weights; libkt trains kt_hf_import's LoRA program (bf16 base, r 8,
 *         alpha 16 on q/k/v/o and on every expert's gate, up and down), PyTorch the
 *         from_pretrained model with PEFT on the same modules
 *
 * Each side runs in a child process of its own (train_proc.h), one after the other, libkt
 * first: its peak RSS is its own. */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kt/kt.h>

#include "tools/common/usage.h"
#include "tools/kt-bench/bench.h"
#include "tools/kt-bench/bench_train.h"
#include "tools/kt-bench/train_proc.h"

#ifndef KT_BENCH_TRAIN_PEER_SCRIPT
#define KT_BENCH_TRAIN_PEER_SCRIPT "tools/kt-bench/train_torch_peer.py"
#endif
#ifndef KT_BENCH_EXAMPLES_DIR
#define KT_BENCH_EXAMPLES_DIR "examples"
#endif

static const char *const tool = "kt-bench train";

/* A side's processes may take minutes at the LoRA size (a step of two 128-expert layers at
 * 1024 tokens is seconds on two cores, loading torch and 2.4 GB of weights more). */
#define CHILD_TIMEOUT_S 3600.0

typedef struct train_opts {
    int configs;  /* bit 0 main, bit 1 lora */
    int64_t layers, batch, seq, vocab; /* 0: the configuration's default */
    int steps, warmup; /* 0: the configuration's default */
    int peer, verbose;
    int shape; /* --lora-shape: 0 30b-a3b, 1 tiny (the tests' sizes), 2 dsv2lite */
    kt_moe_quant quant; /* --moe-dtype int8|int4: the lora configuration's frozen experts */
    int group;          /* --moe-group */
    const char *ktg, *python, *script, *experts_impl;
} train_opts;

/* The main job's sizes, for examples/qwen3_moe.ktg until examples/moe_lm.ktg is there. */
static const kt_ktg_define main_job_sizes[] = {
    {"B", 16}, {"T", 128}, {"VOCAB", 257}, {"H", 128}, {"HQ", 4}, {"HKV", 2}, {"D", 32},
    {"E", 32}, {"TOPK", 2}, {"L", 4}};
#define MAIN_JOB_INTER 256

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kt-bench train [--config main|lora] [--layers N] [--batch B] [--seq T]\n"
        "                      [--steps N] [--warmup N] [--threads N] [--json] [--no-peer]\n"
        "                      [--ktg FILE] [--vocab V] [--torch-python PATH]\n"
        "                      [--peer-script PATH] [--torch-experts IMPL]\n"
        "                      [--lora-shape 30b-a3b|tiny|dsv2lite]\n"
        "                      [--moe-dtype bf16|int8|int4] [--moe-group G] [--verbose]\n"
        "Trains one model with libkt and with PyTorch, the same model, batch and optimizer\n"
        "(AdamW, lr 1e-3, no weight decay) on the same threads, one after the other, each in\n"
        "a process of its own, and prints tokens/s of each (a step's tokens over the median\n"
        "step time after the warm-up), their ratio, and the peak RSS of each process.\n"
        "\n"
        "  main  the main job's model (examples/moe_lm.ktg, else examples/qwen3_moe.ktg at\n"
        "        its sizes; --ktg FILE another), every parameter trained in f32; --batch,\n"
        "        --seq and --layers set its B, T and L. PyTorch: transformers'\n"
        "        Qwen3MoeForCausalLM of the program's sizes, f32.\n"
        "  lora  LoRA r 8, alpha 16 on q/k/v/o and the experts of a Qwen3-MoE with hidden 2048,\n"
        "        32 heads of 128, 4 KV heads, 128 experts top-8 of 768, the base frozen in\n"
        "        bf16 (default 2 layers, T 1024, B 1, vocabulary 4096), from a random\n"
        "        checkpoint written to a temporary directory; libkt: kt_hf_import's program\n"
        "        (one adapter per expert and projection), PyTorch: from_pretrained in bf16 and\n"
        "        PEFT (LoraConfig on the same module names; adapters f32). --lora-shape tiny:\n"
        "        hidden 64, 4 heads of 16, 2 KV heads, 8 experts top-2 of 32, T 32, vocabulary\n"
        "        256 (the tests' size; experts of 64 with --moe-dtype int8|int4).\n"
        "        --lora-shape dsv2lite: DeepSeek-V2-Lite's config\n"
        "        (vocabulary 102400, hidden 2048, 27 layers, the first dense of 10944, 64\n"
        "        routed experts top-6 of 1408 and 2 shared, MLA: 16 heads, kv_lora_rank 512,\n"
        "        qk 128+64, v 128, no q LoRA, yarn RoPE), a ~31 GB checkpoint at 27 layers\n"
        "        (--layers N: fewer), written tensor by tensor; no PyTorch peer (it cannot\n"
        "        hold the model in this machine's memory). --moe-dtype int8|int4: libkt's\n"
        "        frozen experts stored quantized as they load (--moe-group: INT4's inputs\n"
        "        per scale, 32, 64 or 128); default bf16.\n"
        "  Both by default. Defaults: main --steps 10 --warmup 2, lora --steps 3 --warmup 1;\n"
        "  all CPUs.\n"
        "\n"
        "The peer: train_torch_peer.py run by the python --torch-python names, else\n"
        "KT_TORCH_PYTHON, else python3 from PATH (torch >= 2, transformers >= 5, peft for\n"
        "lora); without it (or with --no-peer) libkt's side alone, the ratios null.\n"
        "--torch-experts: transformers' experts implementation: grouped_mm (its default,\n"
        "and the default here), batched_mm or eager. --verbose: the children's output.\n");
}

/* ---- options ---------------------------------------------------------------------------- */

static int parse(int argc, char **argv, train_opts *o)
{
    static const char *const valued[] = {"--config", "--layers", "--batch", "--seq", "--steps",
                                         "--warmup", "--ktg", "--vocab", "--torch-python",
                                         "--peer-script", "--torch-experts", "--lora-shape",
                                         "--moe-dtype", "--moe-group"};
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
            usage(stdout);
            return -1;
        }
        if (strcmp(s, "--no-peer") == 0) {
            o->peer = 0;
            continue;
        }
        if (strcmp(s, "--verbose") == 0) {
            o->verbose = 1;
            continue;
        }
        if (!bench_is_one_of(s, valued, (int)(sizeof valued / sizeof valued[0])))
            return kt_tool_usage_error(tool, "unknown option '%s'", s);
        if (i + 1 >= argc)
            return kt_tool_usage_error(tool, "%s needs a value", s);
        const char *v = argv[++i];
        long long x = 0;
        if (strcmp(s, "--config") == 0) {
            if (strcmp(v, "main") != 0 && strcmp(v, "lora") != 0)
                return kt_tool_usage_error(tool, "--config: 'main' or 'lora', not '%s'", v);
            o->configs = strcmp(v, "main") == 0 ? 1 : 2;
        } else if (strcmp(s, "--ktg") == 0) {
            o->ktg = v;
        } else if (strcmp(s, "--torch-python") == 0) {
            o->python = v;
        } else if (strcmp(s, "--peer-script") == 0) {
            o->script = v;
        } else if (strcmp(s, "--torch-experts") == 0) {
            static const char *const impls[] = {"grouped_mm", "batched_mm", "eager"};
            if (!bench_is_one_of(v, impls, 3))
                return kt_tool_usage_error(tool, "--torch-experts: grouped_mm, batched_mm or "
                                           "eager, not '%s'", v);
            o->experts_impl = v;
        } else if (strcmp(s, "--lora-shape") == 0) {
            static const char *const shapes[] = {"30b-a3b", "tiny", "dsv2lite"};
            int k = 0;
            while (k < 3 && strcmp(v, shapes[k]) != 0)
                k++;
            if (k == 3)
                return kt_tool_usage_error(tool, "--lora-shape: '30b-a3b', 'tiny' or "
                                           "'dsv2lite', not '%s'", v);
            o->shape = k;
        } else if (strcmp(s, "--moe-dtype") == 0) {
            if (strcmp(v, "bf16") == 0)
                o->quant = KT_MOE_QUANT_NONE;
            else if (strcmp(v, "int8") == 0)
                o->quant = KT_MOE_QUANT_INT8;
            else if (strcmp(v, "int4") == 0)
                o->quant = KT_MOE_QUANT_INT4;
            else
                return kt_tool_usage_error(tool, "--moe-dtype: bf16, int8 or int4, not '%s'",
                                           v);
        } else if (strcmp(s, "--moe-group") == 0) {
            if (strcmp(v, "32") != 0 && strcmp(v, "64") != 0 && strcmp(v, "128") != 0)
                return kt_tool_usage_error(tool, "--moe-group: 32, 64 or 128, not '%s'", v);
            o->group = atoi(v);
        } else {
            const long long hi = strcmp(s, "--warmup") == 0 ? 1000 : 1 << 20;
            if (kt_tool_parse_int(tool, s, v, strcmp(s, "--warmup") == 0 ? 0 : 1, hi, &x) != 0)
                return 2;
            if (strcmp(s, "--layers") == 0)
                o->layers = x;
            else if (strcmp(s, "--batch") == 0)
                o->batch = x;
            else if (strcmp(s, "--seq") == 0)
                o->seq = x;
            else if (strcmp(s, "--vocab") == 0)
                o->vocab = x;
            else if (strcmp(s, "--steps") == 0)
                o->steps = (int)x;
            else
                o->warmup = (int)x;
        }
    }
    if (o->ktg != NULL && o->configs == 2)
        return kt_tool_usage_error(tool, "%s", "--ktg names the main configuration's model, "
                                   "not lora's");
    if (o->group > 0 && o->quant != KT_MOE_QUANT_INT4)
        return kt_tool_usage_error(tool, "%s", "--moe-group is INT4's: add --moe-dtype int4");
    if ((o->quant != KT_MOE_QUANT_NONE || o->shape != 0) && o->configs != 2)
        return kt_tool_usage_error(tool, "%s", "--moe-dtype and --lora-shape are the lora "
                                   "configuration's: add --config lora");
    if (o->vocab > 0 && o->configs != 2)
        return kt_tool_usage_error(tool, "%s", "--vocab is the lora configuration's (the main "
                                   "one's comes from its .ktg): add --config lora");
    return 0;
}

/* ---- the report ------------------------------------------------------------------------- */

typedef struct side {
    int ran;          /* a result came back */
    double tokens_per_s, step_ms;
    int64_t peak_rss, trainable;
    double loss_first, loss_last;
    char note[600];
} side;

static void read_side(const train_proc *p, side *s)
{
    s->ran = 1;
    s->tokens_per_s = train_proc_value(p, "\"tokens_per_s\"");
    s->step_ms = train_proc_value(p, "\"step_ms\"");
    s->trainable = (int64_t)train_proc_value(p, "\"trainable_params\"");
    s->peak_rss = p->peak_rss_bytes;
    const char *l = strstr(p->result, "\"losses\"");
    if (l != NULL && sscanf(strchr(l, '[') ? strchr(l, '[') : l, "[%lf, %lf]", &s->loss_first,
                            &s->loss_last) != 2)
        s->loss_first = s->loss_last = -1;
}

static void print_number(const char *key, double v, int have, int comma)
{
    if (have && v == (double)(long long)v && v < 9e15 && v > -9e15)
        printf("\"%s\":%lld%s", key, (long long)v, comma ? "," : "");
    else if (have)
        printf("\"%s\":%.6g%s", key, v, comma ? "," : "");
    else
        printf("\"%s\":null%s", key, comma ? "," : "");
}

typedef struct config_desc {
    const char *name, *model, *dtype, *moe_mode;
    int64_t batch, seq, layers, params;
    int threads, steps, warmup;
    const train_shape *shape;
} config_desc;

static void report(const config_desc *c, const side *k, const side *t, const train_opts *o,
                   int json)
{
    const int have = t->ran && t->tokens_per_s > 0 && k->tokens_per_s > 0;
    const double ratio = have ? k->tokens_per_s / t->tokens_per_s : 0;
    const int have_rss = have && t->peak_rss > 0 && k->peak_rss > 0;
    const double rss = have_rss ? (double)k->peak_rss / (double)t->peak_rss : 0;
    if (json) {
        const train_shape *s = c->shape;
        printf("{\"bench\":\"train\",\"config\":{\"config\":\"%s\",\"model\":\"", c->name);
        bench_print_json_text(c->model);
        printf("\",\"batch\":%lld,\"seq\":%lld,\"layers\":%lld,\"hidden\":%lld,\"heads\":%lld,"
               "\"kv_heads\":%lld,\"head_dim\":%lld,\"experts\":%lld,\"top_k\":%lld,"
               "\"intermediate\":%lld,\"vocab\":%lld,\"params\":%lld,\"dtype\":\"%s\","
               "\"moe_mode\":\"%s\",\"optimizer\":\"adamw\",\"lr\":0.001,\"threads\":%d,"
               "\"steps\":%d,\"warmup\":%d,\"torch_attn\":\"sdpa\",\"torch_experts\":\"%s\"},",
               (long long)c->batch, (long long)c->seq, (long long)c->layers,
               (long long)s->hidden, (long long)s->heads, (long long)s->kv_heads,
               (long long)s->head_dim, (long long)s->experts, (long long)s->top_k,
               (long long)s->inter, (long long)s->vocab, (long long)c->params, c->dtype,
               c->moe_mode, c->threads, c->steps, c->warmup, o->experts_impl);
        print_number("tokens_per_s", k->tokens_per_s, 1, 1);
        print_number("step_ms", k->step_ms, 1, 1);
        print_number("torch_tokens_per_s", t->tokens_per_s, have, 1);
        print_number("torch_step_ms", t->step_ms, have, 1);
        print_number("ratio_vs_torch", ratio, have, 1);
        print_number("peak_rss_bytes", (double)k->peak_rss, k->peak_rss > 0, 1);
        print_number("torch_peak_rss_bytes", (double)t->peak_rss, have_rss, 1);
        print_number("peak_rss_vs_torch", rss, have_rss, 1);
        print_number("trainable_params", (double)k->trainable, 1, 1);
        print_number("torch_trainable_params", (double)t->trainable, have, 1);
        print_number("loss_last", k->loss_last, 1, 1);
        print_number("torch_loss_last", t->loss_last, have, have ? 0 : 1);
        if (!have) {
            printf("\"note\":\"");
            bench_print_json_text(t->note[0] ? t->note : "the peer gave no figures");
            printf("\"");
        }
        printf("}\n");
    } else {
        printf("train %s (%s: B=%lld T=%lld, %lld layers, %lld params, %s, %s, adamw), "
               "%d threads, median of %d steps:\n", c->name, c->model, (long long)c->batch,
               (long long)c->seq, (long long)c->layers, (long long)c->params, c->dtype,
               c->moe_mode, c->threads, c->steps);
        printf("  libkt  %10.1f tokens/s (%.0f ms a step), peak RSS %8.1f MB, %lld trained\n",
               k->tokens_per_s, k->step_ms, (double)k->peak_rss / 1e6, (long long)k->trainable);
        if (have) {
            printf("  torch  %10.1f tokens/s (%.0f ms a step), peak RSS %8.1f MB, %lld trained\n",
                   t->tokens_per_s, t->step_ms, (double)t->peak_rss / 1e6,
                   (long long)t->trainable);
            printf("  ratio  %.2fx torch's tokens/s (target >= 2.5), peak RSS %.2fx torch's "
                   "(target <= 0.6)\n", ratio, rss);
        } else {
            printf("  torch  not measured: %s\n", t->note[0] ? t->note : "no figures");
        }
    }
    fflush(stdout);
}

/* ---- running the two sides -------------------------------------------------------------- */

static const char *python_of(const train_opts *o)
{
    const char *env = getenv("KT_TORCH_PYTHON");
    return o->python ? o->python : env && env[0] ? env : "python3";
}

static void run_libkt(train_job *job, const train_opts *o, side *k)
{
    train_proc p;
    if (train_proc_run(train_libkt_child, job, NULL, CHILD_TIMEOUT_S, o->verbose, &p) == 0) {
        read_side(&p, k);
    } else {
        snprintf(k->note, sizeof k->note, "libkt's side failed (%s): %.400s", p.what,
                 p.last[0] ? p.last : "no output");
    }
}

/* args: the peer's arguments after the script (NULL-terminated) */
static void run_torch(const train_opts *o, char **args, side *t)
{
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)python_of(o);
    argv[n++] = (char *)o->script;
    for (int i = 0; args[i] != NULL && n < 62; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    train_proc p;
    if (train_proc_run(NULL, NULL, argv, CHILD_TIMEOUT_S, o->verbose, &p) == 0) {
        read_side(&p, t);
        return;
    }
    const char *why = p.last[0] ? p.last : p.result[0] ? p.result : "no output";
    snprintf(t->note, sizeof t->note, "torch peer did not run (%s): %.400s", p.what, why);
}

/* The number after "NAME = " in the first line of the text that has it (a .ktg attribute,
 * for what the compiled program does not say: rope's theta, the router's norm_topk). */
static double ktg_attr(const char *text, const char *name, double fallback)
{
    char key[64];
    snprintf(key, sizeof key, "%s = ", name);
    const char *at = strstr(text, key);
    return at != NULL ? atof(at + strlen(key)) : fallback;
}

/* A parameter's dimension by name; -1 when the program has no such parameter. */
static int64_t param_dim(const kt_program *p, const char *name, int dim)
{
    for (int i = 0; i < kt_program_count(p, KT_ROLE_PARAM); i++) {
        const char *n;
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_PARAM, i, &n, &meta) == KT_OK &&
            strcmp(n, name) == 0)
            return dim < meta.ndim ? meta.shape[dim] : -1;
    }
    return -1;
}

static int64_t param_count(const kt_program *p, const train_shape *s)
{
    const int64_t moe_layers = kt_program_moe_count(p);
    int64_t n = 0; /* the model's: LoRA adapters are not counted */
    for (int i = 0; i < kt_program_count(p, KT_ROLE_PARAM); i++) {
        const char *name;
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, &meta) == KT_OK &&
            strstr(name, ".lora_A.") == NULL && strstr(name, ".lora_B.") == NULL)
            n += kt_tensor_numel(&meta);
    }
    return n + moe_layers * s->experts * 3 * s->hidden * s->inter;
}

/* The Qwen3-MoE sizes of a compiled program (transformers' parameter names), for the peer. */
static int shape_of(const kt_program *p, const char *text, int64_t fallback_inter,
                    train_shape *s)
{
    memset(s, 0, sizeof *s);
    s->vocab = param_dim(p, "model.embed_tokens.weight", 0);
    s->hidden = param_dim(p, "model.embed_tokens.weight", 1);
    s->head_dim = param_dim(p, "model.layers.0.self_attn.q_norm.weight", 0);
    const int64_t q = param_dim(p, "model.layers.0.self_attn.q_proj.weight", 0);
    const int64_t k = param_dim(p, "model.layers.0.self_attn.k_proj.weight", 0);
    s->layers = kt_program_moe_count(p);
    kt_program_moe m;
    if (s->vocab < 1 || s->hidden < 1 || s->head_dim < 1 || q < 1 || k < 1 || s->layers < 1 ||
        kt_program_moe_info(p, 0, &m) != KT_OK || m.n_experts < 1) {
        fprintf(stderr, "%s: the main model is not a Qwen3-MoE under transformers' names "
                "(model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
                "q_norm, k_proj, a moe op after a topk_router in every layer)\n", tool);
        return 1;
    }
    s->heads = q / s->head_dim;
    s->kv_heads = k / s->head_dim;
    s->experts = m.n_experts;
    s->top_k = m.top_k;
    s->inter = m.intermediate > 0 ? m.intermediate : fallback_inter;
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *n;
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &n, &meta) == KT_OK &&
            (strcmp(n, "tokens") == 0 || strcmp(n, "input_ids") == 0) && meta.ndim == 2) {
            s->batch = meta.shape[0];
            s->seq = meta.shape[1];
        }
    }
    if (s->batch < 1) {
        fprintf(stderr, "%s: the main model has no tokens input [B, T]\n", tool);
        return 1;
    }
    s->rope_theta = ktg_attr(text, "theta", 10000.0);
    s->norm_topk = ktg_attr(text, "norm_topk", 0.0) != 0.0;
    const char *lb = strstr(text, "load_balance_loss(");
    const char *coef = lb != NULL ? strstr(lb, "alpha = ") : NULL;
    s->aux_coef = lb == NULL ? 0.0 : coef != NULL ? atof(coef + 8) : 1.0;
    return 0;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    long n = -1;
    if (f != NULL && fseek(f, 0, SEEK_END) == 0)
        n = ftell(f);
    char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
    const int ok = text != NULL && fseek(f, 0, SEEK_SET) == 0 &&
                   fread(text, 1, (size_t)n, f) == (size_t)n;
    if (f != NULL)
        fclose(f);
    if (!ok) {
        free(text);
        fprintf(stderr, "%s: cannot read %s\n", tool, path);
        return NULL;
    }
    text[n] = '\0';
    *len = (size_t)n;
    return text;
}

static void peer_args_shape(char **args, int *n, char (*buf)[32], const train_shape *s,
                            const train_opts *o, const config_desc *c)
{
    const struct { const char *opt; double v; int is_int; } a[] = {
        {"--threads", c->threads, 1}, {"--batch", (double)c->batch, 1},
        {"--seq", (double)c->seq, 1}, {"--steps", c->steps, 1}, {"--warmup", c->warmup, 1},
        {"--vocab", (double)s->vocab, 1}, {"--hidden", (double)s->hidden, 1},
        {"--heads", (double)s->heads, 1}, {"--kv-heads", (double)s->kv_heads, 1},
        {"--head-dim", (double)s->head_dim, 1}, {"--experts", (double)s->experts, 1},
        {"--top-k", (double)s->top_k, 1}, {"--inter", (double)s->inter, 1},
        {"--layers", (double)s->layers, 1}, {"--rope-theta", s->rope_theta, 0},
        {"--norm-topk", s->norm_topk, 1}, {"--aux-coef", s->aux_coef, 0}};
    for (size_t i = 0; i < sizeof a / sizeof a[0]; i++) {
        args[(*n)++] = (char *)a[i].opt;
        if (a[i].is_int)
            snprintf(buf[i], 32, "%lld", (long long)a[i].v);
        else
            snprintf(buf[i], 32, "%.9g", a[i].v);
        args[(*n)++] = buf[i];
    }
    args[(*n)++] = "--experts-impl";
    args[(*n)++] = (char *)o->experts_impl;
}

static int run_main(const train_opts *o, int threads, int json)
{
    char path[4096];
    const int own = o->ktg == NULL;
    snprintf(path, sizeof path, "%s/moe_lm.ktg", KT_BENCH_EXAMPLES_DIR);
    const int fallback = own && access(path, R_OK) != 0;
    if (fallback)
        snprintf(path, sizeof path, "%s/qwen3_moe.ktg", KT_BENCH_EXAMPLES_DIR);
    const char *file = own ? path : o->ktg;
    size_t len;
    char *text = read_file(file, &len);
    if (text == NULL)
        return 1;
    kt_ktg_define d[16];
    int nd = 0;
    if (fallback)
        for (size_t i = 0; i < sizeof main_job_sizes / sizeof main_job_sizes[0]; i++)
            d[nd++] = main_job_sizes[i];
    const struct { const char *name; int64_t v; } over[] = {
        {"B", o->batch}, {"T", o->seq}, {"L", o->layers}};
    for (int i = 0; i < 3; i++) {
        if (over[i].v <= 0)
            continue;
        int at = 0;
        while (at < nd && strcmp(d[at].name, over[i].name) != 0)
            at++;
        d[at] = (kt_ktg_define){over[i].name, over[i].v};
        nd += at == nd;
    }
    kt_graph *g = NULL;
    kt_program *p = NULL;
    char diag[4096];
    int rc = 1;
    train_shape s;
    if (kt_ktg_parse(text, len, file, d, nd, &g, diag, sizeof diag, NULL) != KT_OK) {
        fprintf(stderr, "%s", diag);
    } else if (kt_compile(g, &(kt_compile_options){.training = 1}, &p) != KT_OK) {
        fprintf(stderr, "%s: cannot compile %s: %s\n", tool, file, kt_last_error());
    } else {
        rc = shape_of(p, text, fallback ? MAIN_JOB_INTER : 0, &s);
    }
    kt_graph_destroy(g);
    if (rc == 0 && s.inter < 1)
        s.inter = 2 * s.hidden; /* kt-train's default for moe ops that leave it open */
    free(text);
    if (rc != 0) {
        kt_program_destroy(p);
        return 1;
    }
    const char *base = strrchr(file, '/') ? strrchr(file, '/') + 1 : file;
    char model[256];
    snprintf(model, sizeof model, "%.200s%s", base, fallback ? " at moe_lm's sizes" : "");
    config_desc c = {.name = "main", .model = model, .dtype = "f32", .moe_mode = "full",
                     .batch = s.batch, .seq = s.seq, .layers = s.layers,
                     .params = param_count(p, &s), .threads = threads,
                     .steps = o->steps ? o->steps : 10, .warmup = o->warmup >= 0 ? o->warmup : 2,
                     .shape = &s};
    train_job job = {.program = p, .moe_dtype = KT_F32, .moe_mode = KT_MOE_FULL,
                     .moe_inter = s.inter, .threads = threads, .steps = c.steps,
                     .warmup = c.warmup, .lr = 1e-3f, .seed = 1};
    side k = {0}, t = {0};
    run_libkt(&job, o, &k);
    kt_program_destroy(p);
    if (!k.ran) {
        fprintf(stderr, "%s: %s\n", tool, k.note);
        return 1;
    }
    if (o->peer) {
        char *args[64], buf[24][32];
        int n = 0;
        args[n++] = "--config";
        args[n++] = "main";
        peer_args_shape(args, &n, buf, &s, o, &c);
        args[n] = NULL;
        run_torch(o, args, &t);
    } else {
        snprintf(t.note, sizeof t.note, "peer not run (--no-peer)");
    }
    report(&c, &k, &t, o, json);
    return 0;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

/* Writes the checkpoint in a child, so that this process never holds its pool (the libkt
 * child forked later would start from this process's resident pages). */
typedef struct ckpt_job {
    const char *dir;
    const train_shape *s;
} ckpt_job;

static int checkpoint_child(void *ctx)
{
    const ckpt_job *j = ctx;
    if (train_write_checkpoint(j->dir, j->s, 1) != 0)
        return 1;
    printf("{\"written\": true}\n");
    return 0;
}

static int run_lora_in(const train_opts *o, int threads, int json, const char *tmp)
{
    /* Qwen3-30B-A3B's layer (tiny: the tests' size) */
    train_shape s = {.hidden = 2048, .heads = 32, .kv_heads = 4, .head_dim = 128,
                     .experts = 128, .top_k = 8, .inter = 768, .rope_theta = 1e6,
                     .norm_topk = 1};
    const int tiny = o->shape == 1, dsv2 = o->shape == 2;
    if (tiny)
        s = (train_shape){.hidden = 64, .heads = 4, .kv_heads = 2, .head_dim = 16,
                          .experts = 8, .top_k = 2, .inter = 32, .rope_theta = 1e6,
                          .norm_topk = 1};
    if (dsv2) /* DeepSeek-V2-Lite's config.json; head_dim: q's (nope + rope) */
        s = (train_shape){.hidden = 2048, .heads = 16, .kv_heads = 16, .head_dim = 192,
                          .experts = 64, .top_k = 6, .inter = 1408, .rope_theta = 10000,
                          .norm_topk = 0, .deepseek_v2 = 1, .kv_lora = 512, .qk_nope = 128,
                          .qk_rope = 64, .v_head = 128, .shared = 2, .first_dense = 1,
                          .dense_inter = 10944};
    if (tiny && o->quant != KT_MOE_QUANT_NONE)
        s.inter = 64; /* the quantized products take inputs in multiples of 64 */
    s.vocab = o->vocab ? o->vocab : tiny ? 256 : dsv2 ? 102400 : 4096;
    s.layers = o->layers ? o->layers : dsv2 ? 27 : 2;
    s.batch = o->batch ? o->batch : 1;
    s.seq = o->seq ? o->seq : tiny ? 32 : 1024;
    char model[4200], weights[4300], imp[4200], ktp[4300];
    snprintf(model, sizeof model, "%s/model", tmp);
    snprintf(weights, sizeof weights, "%s/model.safetensors", model);
    snprintf(imp, sizeof imp, "%s/import", tmp);
    snprintf(ktp, sizeof ktp, "%s/model.ktp", imp);
    if (mkdir(model, 0700) != 0) {
        fprintf(stderr, "%s: cannot create %s\n", tool, model);
        return 1;
    }
    train_proc wp;
    const ckpt_job cj = {model, &s};
    fprintf(stderr, "%s: writing a random %s checkpoint (%lld layers, bf16) to %s\n", tool,
            dsv2 ? "DeepSeek-V2" : "Qwen3-MoE", (long long)s.layers, model);
    if (train_proc_run(checkpoint_child, (void *)&cj, NULL, CHILD_TIMEOUT_S, o->verbose,
                       &wp) != 0) {
        fprintf(stderr, "%s: writing the checkpoint failed (%s): %s\n", tool, wp.what, wp.last);
        return 1;
    }
    const kt_hf_options ho = {.batch = s.batch, .seq = s.seq, .dtype = KT_BF16,
                              .lora_rank = 8, .lora_alpha = 16.0f};
    kt_program *p = NULL;
    fprintf(stderr, "%s: importing it (kt_hf_import, LoRA r 8, bf16 base)\n", tool);
    if (kt_hf_import(model, &ho, imp) != KT_OK || kt_program_load(ktp, &p) != KT_OK) {
        fprintf(stderr, "%s: kt-import of the checkpoint: %s\n", tool, kt_last_error());
        return 1;
    }
    config_desc c = {.name = "lora",
                     .model = tiny ? "qwen3_moe tiny (random, bf16 base)"
                            : dsv2 ? "deepseek_v2 V2-Lite (random, bf16 base)"
                                   : "qwen3_moe 30B-A3B layers (random, bf16 base)",
                     .dtype = o->quant == KT_MOE_QUANT_INT4 ? "bf16, int4 experts"
                            : o->quant == KT_MOE_QUANT_INT8 ? "bf16, int8 experts"
                                                            : "bf16",
                     .moe_mode = "lora", .batch = s.batch, .seq = s.seq, .layers = s.layers,
                     .params = param_count(p, &s), .threads = threads,
                     .steps = o->steps ? o->steps : 3, .warmup = o->warmup >= 0 ? o->warmup : 1,
                     .shape = &s};
    train_job job = {.program = p, .params = weights, .moe_dtype = KT_BF16,
                     .moe_quant = o->quant, .moe_group = o->group, .moe_mode = KT_MOE_LORA, .lora_rank = 8, .lora_alpha = 16.0f,
                     .threads = threads, .steps = c.steps, .warmup = c.warmup, .lr = 1e-3f,
                     .seed = 1};
    side k = {0}, t = {0};
    fprintf(stderr, "%s: training with libkt (%s experts, T=%lld, %d+%d steps)\n", tool,
            o->quant ? kt_moe_quant_name(o->quant) : "bf16", (long long)s.seq, c.warmup, c.steps);
    run_libkt(&job, o, &k);
    kt_program_destroy(p);
    if (!k.ran) {
        fprintf(stderr, "%s: %s\n", tool, k.note);
        return 1;
    }
    if (dsv2) {
        snprintf(t.note, sizeof t.note, "no PyTorch peer for dsv2lite: transformers holds "
                 "the whole bf16 model (~31 GB at 27 layers), more than this kind of machine's "
                 "memory");
    } else if (o->peer) {
        char th[16], b[24], sq[24], st[16], wu[16];
        snprintf(th, sizeof th, "%d", threads);
        snprintf(b, sizeof b, "%lld", (long long)s.batch);
        snprintf(sq, sizeof sq, "%lld", (long long)s.seq);
        snprintf(st, sizeof st, "%d", c.steps);
        snprintf(wu, sizeof wu, "%d", c.warmup);
        char *args[] = {"--config", "lora", "--model", model, "--threads", th, "--batch", b,
                        "--seq", sq, "--steps", st, "--warmup", wu, "--lora-rank", "8",
                        "--lora-alpha", "16", "--experts-impl", (char *)o->experts_impl, NULL};
        run_torch(o, args, &t);
    } else {
        snprintf(t.note, sizeof t.note, "peer not run (--no-peer)");
    }
    report(&c, &k, &t, o, json);
    return 0;
}

static int run_lora(const train_opts *o, int threads, int json)
{
    const char *base = getenv("TMPDIR");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/kt-bench-train.XXXXXX", base && base[0] ? base : "/tmp");
    if (mkdtemp(tmp) == NULL) {
        fprintf(stderr, "%s: cannot create a temporary directory under %s\n", tool,
                base && base[0] ? base : "/tmp");
        return 1;
    }
    /* a signal kills the running child, and the 2.4 GB checkpoint goes with the directory */
    train_proc_catch_signals();
    const int rc = train_proc_interrupted ? 1 : run_lora_in(o, threads, json, tmp);
    nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    train_proc_reraise();
    return rc;
}

int bench_train(int argc, char **argv, const bench_args *common)
{
    static char found[4096];
    train_opts o = {.configs = 3, .peer = 1, .warmup = -1, .experts_impl = "grouped_mm",
                    .script = bench_find_script(KT_BENCH_TRAIN_PEER_SCRIPT, "train_torch_peer.py",
                                                found, sizeof found)};
    int rc = parse(argc, argv, &o);
    if (rc != 0)
        return rc < 0 ? 0 : rc;
    const int threads = common->threads_given ? common->threads
                                              : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if ((o.configs & 1) && (rc = run_main(&o, threads, common->json)) != 0)
        return rc;
    if (o.configs & 2)
        rc = run_lora(&o, threads, common->json);
    return rc;
}
