/* kt-graphc: compiles a model description (.ktg, docs/ktg.md) into a program file (.ktp).
 *
 *   kt-graphc model.ktg -o model.ktp [-D NAME=VALUE ...] [--print-plan] [--dot out.dot]
 *             [--forward-only] [--check-peak RATIO]
 *
 * Exit status: 0 compiled; 1 the model has errors (all diagnostics on stderr), could not be
 * compiled or written, or its planned peak exceeds --check-peak; 2 a usage error. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt/io.h"
#include "kt/kt.h"
#include "kt/program.h"
#include "tools/common/files.h"
#include "tools/common/usage.h"

#define MAX_DEFINES 64
#define DIAG_BYTES (256u * 1024u)

typedef struct args {
    const char *input, *output, *dot;
    int print_plan, forward_only;
    double check_peak; /* 0: no check */
    int override_checkpoint;
    kt_checkpoint_policy checkpoint;
    kt_ktg_define defines[MAX_DEFINES];
    int n_defines;
} args;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-graphc model.ktg [-o model.ktp] [options]\n"
            "\n"
            "Compiles a model description (docs/ktg.md) into a program file.\n"
            "\n"
            "options:\n"
            "  -o FILE             write the compiled program (.ktp) to FILE\n"
            "  -D NAME=VALUE       override the file's 'const NAME' (repeatable)\n"
            "  --print-plan        print the schedule, every buffer's offset and lifetime,\n"
            "                      the planned peak against the lower bound, and FLOPs\n"
            "  --dot FILE          write the program as a Graphviz digraph to FILE\n"
            "  --forward-only      compile forward only (no backward, no loss needed)\n"
            "  --checkpoint P      activation checkpointing policy, instead of the file's:\n"
            "                      none, segments, every:K, sqrtn or budget:BYTES\n"
            "  --check-peak RATIO  fail (exit 1) when the planned peak exceeds RATIO times\n"
            "                      the lower bound\n"
            "  -h, --help          this text\n"
            "\n"
            "exit status: 0 compiled, 1 errors in the model or its compilation, 2 usage\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    return kt_tool_usage_error("kt-graphc", fmt, arg);
}

static int parse_define(args *a, const char *spec)
{
    const char *eq = strchr(spec, '=');
    if (eq == NULL || eq == spec)
        return usage_error("-D needs NAME=VALUE, got '%s'", spec);
    if (a->n_defines == MAX_DEFINES)
        return usage_error("too many -D options (at most 64), at '%s'", spec);
    long long v;
    char opt[80];
    snprintf(opt, sizeof opt, "-D %.*s", (int)(eq - spec < 64 ? eq - spec : 64), spec);
    if (kt_tool_parse_int("kt-graphc", opt, eq + 1, LLONG_MIN, LLONG_MAX, &v) != 0)
        return 2;
    size_t n = (size_t)(eq - spec);
    char *name = malloc(n + 1);
    if (name == NULL)
        return usage_error("out of memory at '%s'", spec);
    memcpy(name, spec, n);
    name[n] = '\0';
    a->defines[a->n_defines].name = name;
    a->defines[a->n_defines].value = v;
    a->n_defines++;
    return 0;
}

static int parse_policy(args *a, const char *spec)
{
    kt_checkpoint_policy *c = &a->checkpoint;
    char *end = NULL;
    memset(c, 0, sizeof *c);
    a->override_checkpoint = 1;
    if (strcmp(spec, "none") == 0)
        c->kind = KT_CHECKPOINT_NONE;
    else if (strcmp(spec, "segments") == 0)
        c->kind = KT_CHECKPOINT_SEGMENTS;
    else if (strcmp(spec, "sqrtn") == 0)
        c->kind = KT_CHECKPOINT_SQRTN;
    else if (strncmp(spec, "every:", 6) == 0) {
        c->kind = KT_CHECKPOINT_EVERY_K;
        const char *k = spec + 6;
        c->k = k[0] >= '0' && k[0] <= '9' ? strtoll(k, &end, 10) : 0;
        if (c->k < 1 || *end != '\0')
            return usage_error("--checkpoint every:K needs K >= 1, got '%s'", spec);
    } else if (strncmp(spec, "budget:", 7) == 0) {
        c->kind = KT_CHECKPOINT_BUDGET;
        c->budget_bytes = strtoull(spec + 7, &end, 10);
        /* (strtoull takes "-5" as 2^64 - 5: a sign is refused here) */
        if (end == spec + 7 || *end != '\0' || c->budget_bytes == 0 || spec[7] == '-' ||
            spec[7] == '+')
            return usage_error("--checkpoint budget:BYTES needs a positive byte count, got '%s'",
                               spec);
    } else
        return usage_error("--checkpoint: unknown policy '%s' (none, segments, every:K, "
                           "sqrtn, budget:BYTES)", spec);
    return 0;
}

/* Returns 0, 2 (usage error) or -1 (--help printed). */
static int parse_args(args *a, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        int has_next = i + 1 < argc;
        if (strcmp(s, "-h") == 0 || strcmp(s, "--help") == 0) {
            usage(stdout);
            return -1;
        } else if (strcmp(s, "-o") == 0 || strcmp(s, "--dot") == 0 ||
                   strcmp(s, "--check-peak") == 0 || strcmp(s, "-D") == 0 ||
                   strcmp(s, "--checkpoint") == 0) {
            if (!has_next)
                return usage_error("%s needs a value", s);
            const char *v = argv[++i];
            if (strcmp(s, "-o") == 0) {
                a->output = v;
            } else if (strcmp(s, "--dot") == 0) {
                a->dot = v;
            } else if (strcmp(s, "-D") == 0) {
                if (parse_define(a, v) != 0)
                    return 2;
            } else if (strcmp(s, "--checkpoint") == 0) {
                if (parse_policy(a, v) != 0)
                    return 2;
            } else {
                if (kt_tool_parse_real("kt-graphc", s, v, 1.0, HUGE_VAL, 0, &a->check_peak) != 0)
                    return 2;
            }
        } else if (strncmp(s, "-D", 2) == 0) {
            if (parse_define(a, s + 2) != 0)
                return 2;
        } else if (strcmp(s, "--print-plan") == 0) {
            a->print_plan = 1;
        } else if (strcmp(s, "--forward-only") == 0) {
            a->forward_only = 1;
        } else if (s[0] == '-' && s[1] != '\0') {
            return usage_error("unknown option '%s'", s);
        } else if (a->input != NULL) {
            return usage_error("more than one model file ('%s')", s);
        } else {
            a->input = s;
        }
    }
    if (a->input == NULL)
        return usage_error("%s", "no model file given");
    return 0;
}

/* A model description is text of a few kilobytes; a larger input (/dev/zero, a binary file
 * named by mistake) is refused rather than read until memory runs out. */
#define MAX_SOURCE_BYTES (64u << 20)

/* NULL with errno set (EFBIG past MAX_SOURCE_BYTES) */
static char *read_file(int fd, size_t *len_out)
{
    FILE *f = fdopen(fd, "rb");
    if (f == NULL) {
        int err = errno;
        close(fd);
        errno = err;
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        len += fread(buf + len, 1, cap - len, f);
        if (len < cap)
            break;
        if (cap >= MAX_SOURCE_BYTES) {
            free(buf);
            fclose(f);
            errno = EFBIG;
            return NULL;
        }
        char *grown = realloc(buf, cap * 2);
        if (grown == NULL) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = grown;
        cap *= 2;
    }
    int failed = ferror(f);
    fclose(f);
    if (failed) {
        free(buf);
        return NULL;
    }
    *len_out = len;
    return buf;
}

static kt_status write_text(const char *path, const char *text, size_t len)
{
    kt_out_file *f = NULL;
    kt_status s = kt_out_open(path, &f);
    if (s == KT_OK)
        s = kt_out_write(f, text, len);
    if (s == KT_OK)
        return kt_out_commit(f);
    kt_out_discard(f);
    return s;
}

/* A kt_program_describe/kt_program_dot result as a heap string. */
static char *render(size_t (*fn)(const kt_program *, char *, size_t), const kt_program *p,
                    size_t *len_out)
{
    size_t n = fn(p, NULL, 0);
    char *s = malloc(n + 1);
    if (s != NULL)
        fn(p, s, n + 1);
    *len_out = n;
    return s;
}

static int run(const args *a)
{
    size_t len;
    int fd;
    if (tool_open_input("kt-graphc", "the model file", a->input, &fd) != 0)
        return 1;
    char *text = read_file(fd, &len);
    if (text == NULL) {
        if (errno == EFBIG)
            fprintf(stderr, "kt-graphc: '%s' is larger than %u MiB: not a model description\n",
                    a->input, MAX_SOURCE_BYTES >> 20);
        else
            fprintf(stderr, "kt-graphc: cannot read '%s': %s\n", a->input, strerror(errno));
        return 1;
    }
    char *diag = malloc(DIAG_BYTES);
    if (diag == NULL) {
        free(text);
        fprintf(stderr, "kt-graphc: out of memory\n");
        return 1;
    }
    kt_graph *g = NULL;
    int n_errors = 0;
    kt_status st = kt_ktg_parse(text, len, a->input, a->defines, a->n_defines, &g, diag,
                                DIAG_BYTES, &n_errors);
    free(text);
    if (st != KT_OK) {
        fputs(diag, stderr);
        fprintf(stderr, "kt-graphc: %s: %d error%s\n", a->input, n_errors,
                n_errors == 1 ? "" : "s");
        free(diag);
        return 1;
    }
    free(diag);
    kt_compile_options opts = {.training = !a->forward_only && kt_graph_has_loss(g),
                               .override_checkpoint = a->override_checkpoint,
                               .checkpoint = a->checkpoint};
    kt_program *p = NULL;
    st = kt_compile(g, &opts, &p);
    /* the same model without checkpointing, for the comparison --print-plan reports */
    kt_program *plain = NULL;
    if (st == KT_OK && a->print_plan && opts.training) {
        kt_compile_options none = opts;
        none.override_checkpoint = 1;
        memset(&none.checkpoint, 0, sizeof none.checkpoint);
        if (kt_compile(g, &none, &plain) != KT_OK)
            plain = NULL;
    }
    kt_graph_destroy(g);
    if (st != KT_OK) {
        fprintf(stderr, "kt-graphc: %s: compiling failed: %s\n", a->input, kt_last_error());
        return 1;
    }
    int rc = 0;
    kt_program_stats stats;
    kt_program_get_stats(p, &stats);
    double ratio = stats.lower_bound_bytes
                       ? (double)stats.arena_bytes / (double)stats.lower_bound_bytes
                       : 1.0;
    if (a->print_plan) {
        size_t n;
        char *plan = render(kt_program_describe, p, &n);
        if (plan != NULL)
            fputs(plan, stdout);
        free(plan);
        if (plain != NULL) {
            kt_program_stats ps;
            kt_program_get_stats(plain, &ps);
            printf("checkpointing: planned peak %llu bytes against %llu without (%.3fx); "
                   "%d recompute steps, %.4g extra FLOPs (%.1f%% of the forward)\n",
                   (unsigned long long)stats.arena_bytes, (unsigned long long)ps.arena_bytes,
                   ps.arena_bytes ? (double)stats.arena_bytes / (double)ps.arena_bytes : 1.0,
                   stats.n_recompute_steps, stats.recompute_flops,
                   stats.forward_flops > 0 ? 100.0 * stats.recompute_flops / stats.forward_flops
                                           : 0.0);
        }
    }
    kt_program_destroy(plain);
    if (a->dot != NULL) {
        size_t n;
        char *dot = render(kt_program_dot, p, &n);
        if (dot == NULL) {
            fprintf(stderr, "kt-graphc: cannot write '%s': out of memory\n", a->dot);
            rc = 1;
        } else if (write_text(a->dot, dot, n) != KT_OK) {
            fprintf(stderr, "kt-graphc: cannot write the graph: %s\n", kt_last_error());
            rc = 1;
        }
        free(dot);
    }
    /* before writing: a build must not be left with the program it was told to refuse */
    if (rc == 0 && a->check_peak > 0 && ratio > a->check_peak) {
        fprintf(stderr, "kt-graphc: %s: planned peak %llu bytes is %.3fx the lower bound "
                "%llu, above --check-peak %.3f; %s not written\n", a->input,
                (unsigned long long)stats.arena_bytes, ratio,
                (unsigned long long)stats.lower_bound_bytes, a->check_peak,
                a->output != NULL ? a->output : "nothing");
        rc = 1;
    }
    if (rc == 0 && a->output != NULL && kt_program_save(p, a->output) != KT_OK) {
        fprintf(stderr, "kt-graphc: cannot write the program: %s\n", kt_last_error());
        rc = 1;
    }
    if (rc == 0)
        printf("compiled %s: %d steps, arena %llu bytes (lower bound %llu, ratio %.3f)\n",
               a->input, stats.n_forward_steps + stats.n_backward_steps,
               (unsigned long long)stats.arena_bytes,
               (unsigned long long)stats.lower_bound_bytes, ratio);
    kt_program_destroy(p);
    return rc;
}

int main(int argc, char **argv)
{
    args a;
    memset(&a, 0, sizeof a);
    int rc = parse_args(&a, argc, argv);
    if (rc == 0 && kt_check_environment() != KT_OK)
        rc = kt_tool_usage_error("kt-graphc", "%s", kt_last_error());
    if (rc == 0) {
        const tool_path paths[] = {
            {"the model file", a.input, 0}, {"-o", a.output, 1}, {"--dot", a.dot, 1}};
        rc = tool_check_paths("kt-graphc", paths, 3);
    }
    if (rc == 0)
        rc = run(&a);
    else if (rc < 0)
        rc = 0;
    for (int i = 0; i < a.n_defines; i++)
        free((void *)a.defines[i].name);
    int out = tool_finish_stdout("kt-graphc");
    return rc != 0 ? rc : out;
}
