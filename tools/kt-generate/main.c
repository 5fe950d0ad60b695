/* kt-generate: continues a prompt from a trained model, one token's forward a token (the
 * key/value cache: decoder.c).
 *
 *   kt-generate DECODE.ktp|DECODE.ktg [-D NAME=VALUE ...] --params CHECKPOINT
 *               (--prompt TEXT | --prompt-ids 1,2,3) [--max-new N] [--greedy]
 *               [--temperature T] [--top-k K] [--top-p P] [--seed S] [--eos ID] [--ids]
 *               [--dump-logits FILE] [--trace FILE] [--threads N]
 *
 * The continuation goes to stdout, the speeds to stderr. Exit status: 0 success, 1 error (one
 * line "kt-generate: ..."), 2 usage error. */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tools/common/files.h"
#include "tools/common/usage.h"
#include "tools/kt-generate/generate.h"

#define DEFAULT_MAX_NEW 64

typedef struct gen_args {
    const char *program, *params, *prompt, *prompt_ids, *dump, *trace;
    kt_ktg_define defines[GEN_MAX_DEFINES];
    int n_defines;
    long long max_new; /* -1: the default */
    double temperature, top_p;
    long long top_k, seed, eos; /* eos -1: none */
    int greedy, sampling_flags, as_ids, threads;
} gen_args;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kt-generate DECODE.ktp|DECODE.ktg [-D NAME=VALUE ...] --params CHECKPOINT\n"
        "                   (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
        "\n"
        "Continues a prompt from a trained model through its decode program, which takes\n"
        "NEW tokens a step and its key/value cache (examples/moe_lm_decode.ktg, the twin\n"
        "of examples/moe_lm.ktg): each new token costs one token's forward. A .ktg is\n"
        "compiled here with the -D overrides (the context C, the model's sizes), once\n"
        "with NEW = 1 and once to take the prompt in one forward; a .ktp (NEW = 1)\n"
        "takes the prompt one token a step. The continuation goes to stdout, the\n"
        "speeds to stderr.\n"
        "\n"
        "  --params FILE|DIR   the checkpoint (parameters and experts by name; the\n"
        "                      optimizer state in it is skipped): kt-train --save's\n"
        "                      file, a kt-train run directory (its newest\n"
        "                      step-N/session.safetensors) or checkpoint directory,\n"
        "                      a Hugging Face model directory\n"
        "  --prompt TEXT       the prompt's bytes are its tokens (byte-level models)\n"
        "  --prompt-ids LIST   the prompt as token ids, 1,2,3\n"
        "  --max-new N         tokens to generate (default %d, or what the context\n"
        "                      leaves); the prompt and N-1 of them must fit in C\n"
        "  --greedy            the most probable token each time (no sampling)\n"
        "  --temperature T     divide the logits by T > 0 (default 1; 0: greedy)\n"
        "  --top-k K           sample among the K most probable (default 0: all)\n"
        "  --top-p P           then among the fewest, most probable first, whose\n"
        "                      probability reaches P, 0 < P <= 1 (default 1: all)\n"
        "  --seed S            the sampler's seed, >= 0 (default 1)\n"
        "  --eos ID            stop after generating this token id (printed too)\n"
        "  --ids               print token ids (1,2,3) instead of text; text prints\n"
        "                      an id below 256 as its byte (\\xNN unless printable\n"
        "                      ASCII, newline or tab; a backslash as \\\\), others\n"
        "                      as \\{ID}\n"
        "  --dump-logits FILE  every forward's logits as safetensors: \"logits\" f32\n"
        "                      [steps, VOCAB] (row i: after feeding token i) and\n"
        "                      \"tokens\" i32 [steps], the tokens fed (to compare\n"
        "                      with a full forward)\n"
        "  --trace FILE        every forward's steps as Chrome trace JSON\n"
        "                      (chrome://tracing, Perfetto): where a token's time goes\n"
        "  --threads N         thread-pool size (default: KT_NUM_THREADS or the CPU\n"
        "                      count)\n"
        "  -h, --help          this text\n"
        "\n"
        "Exit status: 0 success, 1 error, 2 usage error.\n", DEFAULT_MAX_NEW);
}

int gen_error(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, GEN_TOOL ": %s\n", msg);
    return 1;
}

static int usage_error(const char *fmt, const char *arg)
{
    return kt_tool_usage_error(GEN_TOOL, fmt, arg);
}

static int parse_define(gen_args *a, const char *spec)
{
    const char *eq = strchr(spec, '=');
    if (eq == NULL || eq == spec)
        return usage_error("-D needs NAME=VALUE, got '%s'", spec);
    if (a->n_defines == GEN_MAX_DEFINES)
        return usage_error("too many -D options (at most 64), at '%s'", spec);
    char opt[80];
    snprintf(opt, sizeof opt, "-D %.*s", (int)(eq - spec < 64 ? eq - spec : 64), spec);
    long long v;
    if (kt_tool_parse_int(GEN_TOOL, opt, eq + 1, LLONG_MIN, LLONG_MAX, &v) != 0)
        return 2;
    char *name = malloc((size_t)(eq - spec) + 1);
    if (name == NULL)
        return usage_error("out of memory at '%s'", spec);
    memcpy(name, spec, (size_t)(eq - spec));
    name[eq - spec] = '\0';
    a->defines[a->n_defines++] = (kt_ktg_define){name, v};
    return 0;
}

/* A number for opt in [lo, hi] (lo_open: lo itself excluded). */
static int parse_real(const char *opt, const char *v, double lo, int lo_open, double hi,
                      double *out)
{
    return kt_tool_parse_real(GEN_TOOL, opt, v, lo, hi, lo_open ? KT_TOOL_LO_OPEN : 0, out);
}

/* Options that take a value; 0, or 2 after a usage error. */
static int parse_value(gen_args *a, const char *opt, const char *v)
{
    const char **file = strcmp(opt, "--params") == 0       ? &a->params
                        : strcmp(opt, "--prompt") == 0      ? &a->prompt
                        : strcmp(opt, "--prompt-ids") == 0  ? &a->prompt_ids
                        : strcmp(opt, "--dump-logits") == 0 ? &a->dump
                        : strcmp(opt, "--trace") == 0       ? &a->trace
                                                            : NULL;
    if (file != NULL) {
        *file = v;
        return 0;
    }
    long long x;
    if (strcmp(opt, "-D") == 0)
        return parse_define(a, v);
    if (strcmp(opt, "--temperature") == 0)
        return a->sampling_flags++, parse_real(opt, v, 0.0, 0, 1e6, &a->temperature);
    if (strcmp(opt, "--top-p") == 0)
        return a->sampling_flags++, parse_real(opt, v, 0.0, 1, 1.0, &a->top_p);
    if (strcmp(opt, "--top-k") == 0)
        return a->sampling_flags++, kt_tool_parse_int(GEN_TOOL, opt, v, 0, INT_MAX, &a->top_k);
    if (strcmp(opt, "--max-new") == 0)
        return kt_tool_parse_int(GEN_TOOL, opt, v, 0, INT_MAX, &a->max_new);
    if (strcmp(opt, "--seed") == 0)
        return kt_tool_parse_int(GEN_TOOL, opt, v, 0, LLONG_MAX, &a->seed);
    if (strcmp(opt, "--eos") == 0)
        return kt_tool_parse_int(GEN_TOOL, opt, v, 0, LLONG_MAX, &a->eos);
    if (kt_tool_parse_int(GEN_TOOL, opt, v, 1, KT_MAX_THREADS, &x) != 0) /* --threads */
        return 2;
    a->threads = (int)x;
    return 0;
}

/* 0, 2 (usage error) or -1 (--help). */
static int parse_args(int argc, char **argv, gen_args *a)
{
    static const char *const valued[] = {"--params", "--prompt", "--prompt-ids",
                                         "--dump-logits", "--trace", "-D",
                                         "--temperature", "--top-p", "--top-k",
                                         "--max-new", "--seed", "--eos", "--threads"};
    memset(a, 0, sizeof *a);
    a->max_new = -1, a->temperature = 1.0, a->top_p = 1.0, a->seed = 1, a->eos = -1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        int takes = 0;
        for (size_t k = 0; k < sizeof valued / sizeof *valued; k++)
            takes |= strcmp(arg, valued[k]) == 0;
        if (takes) {
            if (i + 1 >= argc)
                return usage_error("%s needs a value", arg);
            if (parse_value(a, arg, argv[++i]) != 0)
                return 2;
        } else if (strncmp(arg, "-D", 2) == 0 && arg[2] != '\0') {
            if (parse_define(a, arg + 2) != 0)
                return 2;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return -1;
        } else if (strcmp(arg, "--greedy") == 0) {
            a->greedy = 1;
        } else if (strcmp(arg, "--ids") == 0) {
            a->as_ids = 1;
        } else if (arg[0] == '-' && arg[1] != '\0') {
            return usage_error("unknown option '%s'", arg);
        } else if (a->program == NULL) {
            a->program = arg;
        } else {
            return usage_error("unexpected argument '%s' (one program only)", arg);
        }
    }
    if (a->program == NULL)
        return usage_error("%s", "no decode program given");
    if (a->params == NULL)
        return usage_error("%s", "--params is required (the trained model's checkpoint)");
    if ((a->prompt == NULL) == (a->prompt_ids == NULL))
        return usage_error("%s", "give one of --prompt TEXT and --prompt-ids LIST");
    if (a->greedy && a->sampling_flags > 0)
        return usage_error("%s", "--greedy takes the most probable token: it does not go "
                           "with --temperature, --top-k or --top-p");
    return 0;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int finite_row(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/* The prompt's ids (not yet checked against a model). */
static int read_prompt(const gen_args *a, int64_t **ids, int64_t *n)
{
    int rc = a->prompt != NULL ? gen_text_ids(a->prompt, ids, n)
                               : gen_parse_ids(a->prompt_ids, ids, n);
    if (rc == 0 && *n == 0)
        rc = usage_error("%s", "the prompt is empty (it needs one token at least)");
    return rc;
}

/* The prompt against the model's vocabulary and context; how many new tokens. */
static int plan(const gen_args *a, const gen_decoder *d, const int64_t *ids, int64_t n,
                int64_t *max_new)
{
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= d->vocab)
            return gen_error("the prompt's token %lld is id %lld, outside the model's "
                             "vocabulary (0..%lld)%s", (long long)i, (long long)ids[i],
                             (long long)(d->vocab - 1),
                             a->prompt != NULL ? ": a byte-level prompt needs VOCAB >= 256"
                                               : "");
    if (a->eos >= d->vocab)
        return gen_error("--eos %lld is outside the model's vocabulary (0..%lld)", a->eos,
                         (long long)(d->vocab - 1));
    if (n > d->context)
        return gen_error("the prompt is %lld tokens, longer than the context of %lld the "
                         "decode program holds (compile it with a larger C: -D C=...)",
                         (long long)n, (long long)d->context);
    /* the last new token is sampled, never fed: the context holds the prompt and N - 1 */
    const int64_t room = d->context - n + 1;
    if (a->max_new > room)
        return gen_error("--max-new %lld: a prompt of %lld tokens leaves room for %lld new "
                         "ones in the context of %lld (compile the decode program with a "
                         "larger C: -D C=...)", a->max_new, (long long)n, (long long)room,
                         (long long)d->context);
    *max_new = a->max_new >= 0 ? a->max_new : room < DEFAULT_MAX_NEW ? room : DEFAULT_MAX_NEW;
    return 0;
}

static void report_speed(const char *what, int64_t n, double seconds)
{
    if (n == 0) {
        fprintf(stderr, GEN_TOOL ": %s: 0 tokens\n", what);
        return;
    }
    fprintf(stderr, GEN_TOOL ": %s: %lld tokens in %.1f ms (%.1f tokens/s, %.3f ms/token)\n",
            what, (long long)n, 1e3 * seconds, seconds > 0 ? (double)n / seconds : 0.0,
            1e3 * seconds / (double)n);
}

static int generate(const gen_args *a)
{
    gen_decoder d;
    gen_sampler smp = {0};
    gen_logit_log log = {0};
    int64_t *ids = NULL, n = 0, max_new = 0;
    const float *logits = NULL;
    memset(&d, 0, sizeof d);
    int rc = read_prompt(a, &ids, &n);
    const gen_decoder_options o = {a->program, a->defines, a->n_defines, a->params,
                                   a->threads, a->trace != NULL, n};
    if (rc == 0)
        rc = gen_decoder_open(&d, &o);
    if (rc == 0)
        rc = plan(a, &d, ids, n, &max_new);
    if (rc == 0)
        rc = gen_sampler_init(&smp, a->greedy, a->temperature, a->top_k, a->top_p,
                              (uint64_t)a->seed, d.vocab);
    log.vocab = d.vocab;
    /* the prompt: every token but the last is only remembered (a prefill takes them at
     * once) */
    const double t0 = now_s();
    if (rc == 0)
        rc = gen_decoder_prefill(&d, ids, a->dump != NULL ? gen_logit_row : NULL, &log);
    for (int64_t i = d.filled; rc == 0 && i < n; i++) {
        rc = gen_decoder_step(&d, ids[i], &logits);
        if (rc == 0 && a->dump != NULL)
            rc = gen_logit_row(&log, ids[i], logits);
    }
    const double t1 = now_s();
    int64_t made = 0;
    while (rc == 0 && made < max_new) {
        if (!finite_row(logits, d.vocab)) {
            rc = gen_error("the logits at position %lld are not finite (a damaged "
                           "checkpoint?)", (long long)(d.filled - 1));
            break;
        }
        const int64_t next = gen_sampler_pick(&smp, logits);
        gen_print_token(stdout, next, a->as_ids, made++);
        fflush(stdout);
        if (next == a->eos || made == max_new)
            break;
        rc = gen_decoder_step(&d, next, &logits);
        if (rc == 0 && a->dump != NULL)
            rc = gen_logit_row(&log, next, logits);
    }
    const double t2 = now_s();
    if (made > 0)
        fputc('\n', stdout);
    if (rc == 0) {
        report_speed("prompt", n, t1 - t0);
        /* the generation's forwards: one fewer than its tokens */
        report_speed("generated", made, t2 - t1);
        if (a->dump != NULL)
            rc = gen_logit_save(&log, a->dump);
        if (rc == 0 && a->trace != NULL)
            rc = gen_decoder_write_trace(&d, a->trace);
    }
    gen_logit_free(&log);
    free(ids);
    gen_sampler_free(&smp);
    gen_decoder_close(&d);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    gen_args a;
    char *checkpoint = NULL;
    int rc = parse_args(argc, argv, &a);
    if (rc == 0 && (rc = gen_checkpoint_path(a.params, &checkpoint)) == 0 && checkpoint) {
        fprintf(stderr, GEN_TOOL ": the checkpoint %s\n", checkpoint);
        a.params = checkpoint;
    }
    if (rc == 0 && kt_check_environment() != KT_OK)
        rc = kt_tool_usage_error(GEN_TOOL, "%s", kt_last_error());
    if (rc == 0) {
        const tool_path paths[] = {{"the program file", a.program, 0},
                                   {"--params", a.params, 0},
                                   {"--dump-logits", a.dump, 1},
                                   {"--trace", a.trace, 1}};
        rc = tool_check_paths(GEN_TOOL, paths, 4);
    }
    if (rc == 0 && (tool_probe_safetensors(GEN_TOOL, "the checkpoint", a.params) != 0 ||
                    tool_probe_output(GEN_TOOL, "the logits", a.dump) != 0 ||
                    tool_probe_output(GEN_TOOL, "the trace", a.trace) != 0))
        rc = 1;
    if (rc == 0)
        rc = generate(&a);
    else if (rc < 0)
        rc = 0;
    for (int i = 0; i < a.n_defines; i++)
        free((char *)a.defines[i].name);
    free(checkpoint);
    int out = tool_finish_stdout(GEN_TOOL);
    return rc != 0 ? rc : out;
}
