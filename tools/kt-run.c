/* kt-run: runs a compiled program (.ktp) on tensors from safetensors files.
 *
 *   kt-run model.ktp --params p.safetensors --inputs in.safetensors --out out.safetensors
 *          [--backward] [--allow-missing] [--allow-unused] [--threads N] [--trace FILE]
 *          [--moe-dtype D] [--moe-mode M] [--moe-inter I] [--lora-rank R] [--lora-alpha A]
 *
 * Loads the parameters and every program input (each checked against the program's dtype and
 * shape), runs forward (and backward), and writes every output under its name and the loss
 * as "loss"; with --backward also every trainable parameter's gradient as "grad.<name>", the
 * MoE layers' (tools/kt-run/moe.c) under their checkpoint names. Errors: "kt-run: <message>"
 * on stderr, exit 1; usage errors exit 2. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/io.h"
#include "kt/program.h"
#include "kt/runtime.h"
#include "tools/common/files.h"
#include "tools/common/usage.h"
#include "tools/kt-run/run_moe.h"

#define GRAD_PREFIX "grad."

typedef struct run_args {
    const char *program, *params, *inputs, *out, *trace;
    int backward, allow_missing, allow_unused, threads;
    run_moe_args moe;
} run_args;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-run model.ktp --params P.safetensors --inputs IN.safetensors\n"
            "              --out OUT.safetensors [--backward] [--threads N] [--trace FILE]\n"
            "\n"
            "Runs a compiled libkt program: loads its parameters and inputs, runs forward\n"
            "(and backward) and writes the outputs as safetensors.\n"
            "\n"
            "  --params FILE     parameters by name (all required unless --allow-missing;\n"
            "                    may be omitted with --allow-missing or when there are none):\n"
            "                    a .safetensors FILE, a sharded checkpoint's index.json, or a\n"
            "                    DIR with model.safetensors.index.json or model.safetensors;\n"
            "                    float dtypes convert to the program's (bf16 -> f32, ...);\n"
            "                    in a program that marks what a checkpoint holds ('loaded',\n"
            "                    as kt-import writes), the others (LoRA adapters) may be\n"
            "                    absent and keep their init\n"
            "  --inputs FILE     every program input by name, with the program's dtype and\n"
            "                    shape (may be omitted when the program has no inputs)\n"
            "  --out FILE        written: every output by name; with --backward also\n"
            "                    \"grad.<param>\" for each trainable parameter and \"loss\"\n"
            "  --backward        run backward after forward (needs a training program)\n"
            "  --allow-missing   parameters absent from --params keep their initial values\n"
            "  --allow-unused    tensors of --params the program has no parameter for are\n"
            "                    skipped (by default they are an error: another model's?)\n"
            "  --threads N       thread-pool size (default: KT_NUM_THREADS or the CPU count)\n"
            "  --trace FILE      write the session's Chrome trace JSON (chrome://tracing)\n"
            "  -h, --help        this text\n"
            "\n"
            "Programs with moe ops: kt-run creates their CPU MoE layers and reads the experts\n"
            "from --params under the ops' names (e.g. model.layers.0.mlp.experts.3.up_proj\n"
            ".weight), with --backward it writes \"grad.<name>\" for every expert weight (full\n"
            "mode) or LoRA adapter (lora mode):\n"
            "  --moe-dtype D     expert weights f32 (default) or bf16\n"
            "  --moe-mode M      full (default; needs f32), lora or frozen\n"
            "  --moe-inter I     the experts' intermediate size, for moe ops that do not say\n"
            "                    theirs (their .ktg 'intermediate')\n"
            "  --lora-rank R     lora mode: the adapters' rank (default 8); the adapters are\n"
            "                    read from --params (...up_proj.lora_A.weight, lora_B)\n"
            "  --lora-alpha A    lora mode: their scale is A / R (default 16)\n"
            "  (--allow-missing: experts or adapters absent from --params keep their initial\n"
            "  values: weights drawn from seed 0, adapters A random and B zero)\n"
            "\n"
            "Exit status: 0 success, 1 error, 2 usage error.\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    return kt_tool_usage_error("kt-run", fmt, arg);
}

/* The MoE options that take a value: 1 when arg is one (*rc: 0 or 2), 0 when it is not. */
static int parse_moe_option(const char *arg, const char *v, run_moe_args *m, int *rc)
{
    static const char *const modes[] = {"frozen", "lora", "full"}; /* kt_moe_mode order */
    long long x;
    *rc = 0;
    if (strcmp(arg, "--moe-dtype") == 0) {
        if (v != NULL && strcmp(v, "f32") == 0)
            m->dtype = KT_F32;
        else if (v != NULL && strcmp(v, "bf16") == 0)
            m->dtype = KT_BF16;
        else
            *rc = usage_error("--moe-dtype needs f32 or bf16, not '%s'", v ? v : "");
    } else if (strcmp(arg, "--moe-mode") == 0) {
        *rc = 2;
        for (int k = 0; k < 3 && v != NULL; k++)
            if (strcmp(v, modes[k]) == 0)
                m->mode = (kt_moe_mode)k, *rc = 0;
        if (*rc != 0)
            usage_error("--moe-mode needs full, lora or frozen, not '%s'", v ? v : "");
    } else if (strcmp(arg, "--moe-inter") == 0 || strcmp(arg, "--lora-rank") == 0) {
        const int inter = arg[2] == 'm';
        if (v == NULL)
            *rc = usage_error("%s needs a value", arg);
        else if (kt_tool_parse_int("kt-run", arg, v, 1, inter ? (1ll << 30) : 256, &x) != 0)
            *rc = 2;
        else if (inter)
            m->inter = x;
        else
            m->lora_rank = x;
    } else if (strcmp(arg, "--lora-alpha") == 0) {
        double alpha;
        if (v == NULL)
            *rc = usage_error("%s needs a value", arg);
        else if (kt_tool_parse_real("kt-run", arg, v, 0, 1e6, KT_TOOL_LO_OPEN, &alpha) != 0)
            *rc = 2;
        else
            m->lora_alpha = (float)alpha;
    } else {
        return 0;
    }
    return 1;
}

/* 0 on success, 2 (usage error), or -1 after --help. */
static int parse_args(int argc, char **argv, run_args *a)
{
    memset(a, 0, sizeof *a);
    a->moe = (run_moe_args){.dtype = KT_F32, .mode = KT_MOE_FULL, .lora_rank = 8,
                            .lora_alpha = 16.0f};
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char **value = NULL;
        int moe_rc;
        if (parse_moe_option(arg, i + 1 < argc ? argv[i + 1] : NULL, &a->moe, &moe_rc)) {
            if (moe_rc != 0)
                return moe_rc;
            i++;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return -1;
        } else if (strcmp(arg, "--backward") == 0) {
            a->backward = 1;
        } else if (strcmp(arg, "--allow-missing") == 0) {
            a->allow_missing = 1;
        } else if (strcmp(arg, "--allow-unused") == 0) {
            a->allow_unused = 1;
        } else if (strcmp(arg, "--params") == 0) {
            value = &a->params;
        } else if (strcmp(arg, "--inputs") == 0) {
            value = &a->inputs;
        } else if (strcmp(arg, "--out") == 0) {
            value = &a->out;
        } else if (strcmp(arg, "--trace") == 0) {
            value = &a->trace;
        } else if (strcmp(arg, "--threads") == 0) {
            if (i + 1 >= argc)
                return usage_error("%s needs a value", arg);
            long long v;
            if (kt_tool_parse_int("kt-run", arg, argv[++i], 1, KT_MAX_THREADS, &v) != 0)
                return 2;
            a->threads = (int)v;
        } else if (arg[0] == '-' && arg[1] != '\0') {
            return usage_error("unknown option '%s'", arg);
        } else if (a->program == NULL) {
            a->program = arg;
        } else {
            return usage_error("unexpected argument '%s' (one program file only)", arg);
        }
        if (value != NULL) {
            if (i + 1 >= argc)
                return usage_error("%s needs a file name", arg);
            *value = argv[++i];
        }
    }
    if (a->program == NULL)
        return usage_error("%s", "no program file given");
    if (a->out == NULL)
        return usage_error("%s", "--out is required");
    if (a->moe.mode == KT_MOE_FULL && a->moe.dtype == KT_BF16)
        return usage_error("%s", "--moe-mode full trains f32 expert weights: use --moe-dtype "
                           "f32, or --moe-mode lora or frozen with bf16");
    return 0;
}

static int fail(const char *what, const char *detail)
{
    fprintf(stderr, "kt-run: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    return 1;
}

/* The tensors written to --out: names and heap copies. */
typedef struct out_list {
    kt_st_item *items;
    char **names;
    size_t n, cap;
} out_list;

static void out_free(out_list *o)
{
    for (size_t i = 0; i < o->n; i++) {
        free(o->names[i]);
        free(o->items[i].tensor.data);
    }
    free(o->items);
    free(o->names);
}

/* Copies t (contiguous CPU) under prefix+name. */
static int out_add(out_list *o, const char *prefix, const char *name, const kt_tensor *t)
{
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 16;
        kt_st_item *items = realloc(o->items, cap * sizeof *items);
        if (items == NULL)
            return fail("out of memory", NULL);
        o->items = items;
        char **names = realloc(o->names, cap * sizeof *names);
        if (names == NULL)
            return fail("out of memory", NULL);
        o->names = names;
        o->cap = cap;
    }
    size_t len = strlen(prefix) + strlen(name) + 1;
    size_t bytes = kt_tensor_nbytes(t);
    char *full = malloc(len);
    void *data = malloc(bytes ? bytes : 1);
    if (full == NULL || data == NULL) {
        free(full);
        free(data);
        return fail("out of memory", NULL);
    }
    snprintf(full, len, "%s%s", prefix, name);
    if (bytes > 0)
        memcpy(data, t->data, bytes);
    kt_tensor copy;
    if (kt_tensor_init(&copy, data, t->dtype, t->ndim, t->shape) != KT_OK) {
        free(full);
        free(data);
        return fail("cannot describe an output tensor", kt_last_error());
    }
    o->names[o->n] = full;
    o->items[o->n].name = full;
    o->items[o->n].tensor = copy;
    o->n++;
    return 0;
}

/* run_moe_gradients' callback: the name is whole already */
static int out_add_named(void *ctx, const char *name, const kt_tensor *t)
{
    return out_add(ctx, "", name, t);
}

static int has_name(const out_list *o, const char *name)
{
    for (size_t i = 0; i < o->n; i++)
        if (strcmp(o->names[i], name) == 0)
            return 1;
    return 0;
}

/* Every program input from the inputs file; tensors the program does not take are noted. */
/* name with bytes outside printable ASCII as \xNN (a program's names are any bytes; stderr
 * stays text), cut to fit buf. */
static const char *escaped(const char *name, char *buf, size_t size)
{
    size_t len = 0;
    for (const unsigned char *c = (const unsigned char *)name; *c && len + 5 <= size; c++) {
        if (*c >= 0x20 && *c < 0x7f)
            buf[len++] = (char)*c;
        else
            len += (size_t)snprintf(buf + len, size - len, "\\x%02x", *c);
    }
    buf[len] = '\0';
    return buf;
}

static int load_inputs(kt_session *s, const kt_program *p, const char *program,
                       const char *path)
{
    int n = kt_program_count(p, KT_ROLE_INPUT);
    if (n == 0) {
        if (path != NULL)
            fprintf(stderr, "kt-run: note: the program takes no inputs; %s is not read\n", path);
        return 0;
    }
    if (path == NULL) {
        const char *name = "";
        kt_program_tensor_info(p, KT_ROLE_INPUT, 0, &name, NULL);
        fprintf(stderr, "kt-run: the program takes %d input%s (the first is '%s'): --inputs is "
                        "required\n", n, n == 1 ? "" : "s", name);
        return 1;
    }
    kt_st_file *f;
    if (kt_st_open(path, &f) != KT_OK)
        return fail("cannot read the inputs", kt_last_error());
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const char *name;
        kt_tensor dst;
        size_t pos;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, NULL) != KT_OK ||
            kt_session_tensor(s, KT_ROLE_INPUT, name, &dst) != KT_OK) {
            rc = fail("cannot look up a program input", kt_last_error());
        } else if (kt_st_lookup(f, name, &pos) != KT_OK) {
            char want[96];
            kt_tensor_describe(&dst, want, sizeof want);
            char shown[4 * 96 + 1];
            fprintf(stderr, "kt-run: input '%s' (%s) of %s is missing from %s\n",
                    escaped(name, shown, sizeof shown), want, program, path);
            rc = 1;
        } else if (kt_st_read(f, name, &dst) != KT_OK) {
            char want[96];
            kt_tensor_describe(&dst, want, sizeof want);
            fprintf(stderr, "kt-run: input '%s': the program takes %s: %s\n", name, want,
                    kt_last_error());
            rc = 1;
        }
    }
    /* tensors in the file that are no input: probably a mistake, but not an error */
    for (size_t i = 0; rc == 0 && i < kt_st_count(f); i++) {
        const char *name = "";
        kt_tensor view;
        kt_st_entry(f, i, &name, NULL); /* a name whatever the dtype */
        if (kt_session_tensor(s, KT_ROLE_INPUT, name, &view) != KT_OK)
            fprintf(stderr, "kt-run: note: %s: tensor '%s' is not a program input (ignored)\n",
                    path, name);
    }
    kt_clear_error();
    kt_st_close(f);
    return rc;
}

static int add_outputs(kt_session *s, const kt_program *p, out_list *o)
{
    int n = kt_program_count(p, KT_ROLE_OUTPUT);
    for (int i = 0; i < n; i++) {
        const char *name;
        kt_tensor t;
        if (kt_program_tensor_info(p, KT_ROLE_OUTPUT, i, &name, NULL) != KT_OK ||
            kt_session_tensor(s, KT_ROLE_OUTPUT, name, &t) != KT_OK)
            return fail("cannot read an output", kt_last_error());
        if (out_add(o, "", name, &t) != 0)
            return 1;
    }
    return 0;
}

static int add_gradients(kt_session *s, const kt_program *p, out_list *o)
{
    int n = kt_program_count(p, KT_ROLE_GRAD);
    for (int i = 0; i < n; i++) {
        const char *name;
        kt_tensor t;
        if (kt_program_tensor_info(p, KT_ROLE_GRAD, i, &name, NULL) != KT_OK ||
            kt_session_tensor(s, KT_ROLE_GRAD, name, &t) != KT_OK)
            return fail("cannot read a gradient", kt_last_error());
        char full[256];
        snprintf(full, sizeof full, GRAD_PREFIX "%s", name);
        if (has_name(o, full)) {
            fprintf(stderr, "kt-run: the gradient name '%s' is also an output name\n", full);
            return 1;
        }
        if (out_add(o, GRAD_PREFIX, name, &t) != 0)
            return 1;
    }
    return 0;
}

static int run(const run_args *a)
{
    int rc = 1;
    kt_program *p = NULL;
    kt_session *s = NULL;
    kt_trace_event *trace = NULL;
    kt_threadpool *pool = NULL;
    kt_moe_layers moe = {0};
    out_list out = {0};

    if (kt_program_load(a->program, &p) != KT_OK) {
        fail("cannot load the program", kt_last_error());
        goto done;
    }
    /* the files are checked before the session commits memory */
    if (tool_probe_safetensors("kt-run", "the parameters", a->params) != 0 ||
        tool_probe_safetensors("kt-run", "the inputs", a->inputs) != 0 ||
        tool_probe_output("kt-run", "the outputs", a->out) != 0 ||
        tool_probe_output("kt-run", "the trace", a->trace) != 0)
        goto done;
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    if (a->backward && st.n_backward_steps == 0) {
        fprintf(stderr, "kt-run: --backward: %s was compiled without training (no backward "
                        "schedule)\n", a->program);
        goto done;
    }
    kt_session_options so;
    memset(&so, 0, sizeof so);
    so.threads = a->threads;
    if (kt_program_moe_count(p) > 0) {
        /* the layers and the session share one pool: the layers run one at a time */
        if (kt_threadpool_create(a->threads, &pool) != KT_OK) {
            fail("cannot start the thread pool", kt_last_error());
            goto done;
        }
        if (run_moe_create(p, &a->moe, pool, &moe) != 0 ||
            run_moe_check_params(p, &moe, a->params, a->allow_missing) != 0)
            goto done;
        so.pool = pool;
        so.moe_layers = moe.layers;
        so.n_moe_layers = moe.n;
    }
    if (a->trace != NULL) {
        so.trace_capacity = (size_t)st.n_forward_steps + (size_t)st.n_backward_steps + 16;
        trace = calloc(so.trace_capacity, sizeof *trace);
        if (trace == NULL) {
            fail("out of memory", NULL);
            goto done;
        }
        so.trace = trace;
    }
    if (kt_session_create(p, &so, &s) != KT_OK) {
        fail("cannot create a session", kt_last_error());
        goto done;
    }
    if (a->params != NULL) {
        const unsigned flags = (a->allow_missing ? KT_LOAD_ALLOW_MISSING : 0u) |
                               (a->allow_unused ? KT_LOAD_ALLOW_UNUSED : 0u) |
                               KT_LOAD_ALLOW_INITIALISED;
        if (kt_session_load(s, a->params, flags) != KT_OK) {
            fail("cannot load the parameters", kt_last_error());
            goto done;
        }
    } else if (st.n_params > 0 && !a->allow_missing) {
        const char *name = "";
        kt_program_tensor_info(p, KT_ROLE_PARAM, 0, &name, NULL);
        fprintf(stderr, "kt-run: the program has %d parameter%s (the first is '%s'): --params "
                        "is required (or --allow-missing to run on initial values)\n",
                st.n_params, st.n_params == 1 ? "" : "s", name);
        goto done;
    }
    if (load_inputs(s, p, a->program, a->inputs) != 0)
        goto done;

    if (kt_session_forward(s) != KT_OK) {
        fail("forward failed", kt_last_error());
        goto done;
    }
    /* Copy the outputs now: they are what forward produced, whatever backward does. */
    if (add_outputs(s, p, &out) != 0)
        goto done;
    float loss = kt_session_loss(s);
    if (a->backward) {
        if (kt_session_backward(s) != KT_OK) {
            fail("backward failed", kt_last_error());
            goto done;
        }
        if (add_gradients(s, p, &out) != 0 ||
            run_moe_gradients(p, &moe, out_add_named, &out) != 0)
            goto done;
    }
    if (isnan(loss)) {
        /* a program without a loss */
    } else if (has_name(&out, "loss")) {
        fprintf(stderr, "kt-run: note: an output is named 'loss'; the loss is not written "
                        "separately\n");
    } else {
        kt_tensor t;
        kt_tensor_init(&t, &loss, KT_F32, 0, NULL);
        if (out_add(&out, "", "loss", &t) != 0)
            goto done;
    }
    if (kt_st_save(a->out, out.items, out.n, NULL) != KT_OK) {
        fail("cannot write the outputs", kt_last_error());
        goto done;
    }
    if (a->trace != NULL &&
        kt_trace_write_json(trace, kt_session_trace_count(s), a->trace) != KT_OK) {
        fail("cannot write the trace", kt_last_error());
        goto done;
    }
    if (!isnan(loss))
        fprintf(stderr, "kt-run: wrote %zu tensors to %s (loss %.6g)\n", out.n, a->out,
                (double)loss);
    else
        fprintf(stderr, "kt-run: wrote %zu tensors to %s\n", out.n, a->out);
    rc = 0;
done:
    out_free(&out);
    kt_session_destroy(s);
    kt_moe_layers_destroy(&moe);
    kt_threadpool_destroy(pool);
    kt_program_destroy(p);
    free(trace);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc == 0 && kt_check_environment() != KT_OK)
        rc = kt_tool_usage_error("kt-run", "%s", kt_last_error());
    if (rc == 0) {
        const tool_path paths[] = {{"the program file", a.program, 0},
                                   {"--params", a.params, 0},
                                   {"--inputs", a.inputs, 0},
                                   {"--out", a.out, 1},
                                   {"--trace", a.trace, 1}};
        rc = tool_check_paths("kt-run", paths, 5);
    }
    if (rc == 0)
        rc = run(&a);
    else if (rc < 0)
        rc = 0;
    int out = tool_finish_stdout("kt-run");
    return rc != 0 ? rc : out;
}
