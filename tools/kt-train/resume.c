/* A checkpoint's run.json: where the run stands (the step, the data position, the random
 * state) and every setting that changes the numbers, so that --resume continues exactly or
 * refuses, naming what differs. Settings are strings (floats as %.9g, which reads back to the
 * same float), compared as written.
 *
 * Random state: kt-train draws random numbers only when it initialises the parameters and the
 * experts (from --seed); a step uses none (no dropout, no shuffling: window i of the file is
 * the i-th window fed). So the seed is recorded, and nothing else is needed to go on; the
 * data position is the number of windows consumed (step x --accum). */
#define _XOPEN_SOURCE 700 /* realpath */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tools/kt-train/flat_json.h"
#include "tools/kt-train/trainer.h"

#define RUN_FORMAT "kt-train-run-1"
#define MAX_JSON_BYTES (1u << 20)

enum { SAME, ROUNDING, RECORD }; /* a difference refuses, warns, or is only recorded */

typedef struct setting {
    const char *key, *what; /* run.json's name; how a message names it */
    int kind;
    char value[512];
} setting;

enum { MAX_SETTINGS = 40 };

static void put(setting *s, int *n, const char *key, const char *what, int kind,
                const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static void put(setting *s, int *n, const char *key, const char *what, int kind,
                const char *fmt, ...)
{
    setting *e = &s[(*n)++];
    e->key = key;
    e->what = what;
    e->kind = kind;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->value, sizeof e->value, fmt, ap);
    va_end(ap);
}

static const char *const schedules[] = {"constant", "cosine", "linear"}; /* enum order */

typedef struct path_text {
    char s[500];
} path_text;

/* A file as an absolute path, so that a resume from another directory finds it (as given
 * when it cannot be resolved, or is too long). */
static path_text absolute(const char *path)
{
    path_text r;
    char *full = realpath(path, NULL);
    snprintf(r.s, sizeof r.s, "%s",
             full != NULL && strlen(full) < sizeof r.s ? full : path);
    free(full);
    return r;
}

static int collect(const trainer *t, const train_args *a, setting *s)
{
    static const char *const modes[] = {"frozen", "lora", "full"};
    int n = 0;
    put(s, &n, "program_fnv1a64", "the program", SAME, "%016llx",
        (unsigned long long)t->program_hash);
    put(s, &n, "data_tokens_fnv1a64", "the --data file's tokens", SAME, "%016llx",
        (unsigned long long)t->data.content_hash);
    put(s, &n, "data_tokens", "the --data file's token count", SAME, "%lld",
        (long long)t->data.n_tokens);
    put(s, &n, "data_format", "--data-format", SAME, "%d", t->data.token_bytes);
    put(s, &n, "data_header", "--data-header", SAME, "%lld", (long long)a->data_header);
    put(s, &n, "allow_cross_document", "--allow-cross-document", SAME, "%d",
        a->allow_cross_document);
    put(s, &n, "tokens_per_window", "the program's tokens per window", SAME, "%lld",
        (long long)t->data.window);
    put(s, &n, "input_names", "--input-tokens/--input-labels/--input-targets", SAME,
        "%.50s,%.50s,%.50s", a->tokens_input, a->labels_input, a->targets_input);
    put(s, &n, "optimizer", "--optimizer", SAME, "%s",
        a->optimizer == KT_OPTIM_ADAMW ? "adamw" : "sgd");
    put(s, &n, "lr", "--lr", SAME, "%.9g", (double)a->lr);
    put(s, &n, "weight_decay", "--weight-decay", SAME, "%.9g", (double)a->weight_decay);
    put(s, &n, "beta1", "--beta1", SAME, "%.9g", (double)a->beta1);
    put(s, &n, "beta2", "--beta2", SAME, "%.9g", (double)a->beta2);
    put(s, &n, "momentum", "--momentum", SAME, "%.9g", (double)a->momentum);
    put(s, &n, "schedule", "--schedule", SAME, "%s", schedules[a->schedule]);
    put(s, &n, "warmup", "--warmup", SAME, "%lld", (long long)a->warmup);
    put(s, &n, "min_lr", "--min-lr", SAME, "%.9g", (double)a->min_lr);
    /* a constant schedule may be run for longer than first planned; the others end at it */
    put(s, &n, "steps", "--steps (the schedule's length)",
        a->schedule == KT_LR_CONSTANT ? RECORD : SAME, "%lld", (long long)a->steps);
    put(s, &n, "clip", "--clip", SAME, "%.9g", (double)a->clip);
    put(s, &n, "accum", "--accum", SAME, "%lld", (long long)a->accum);
    put(s, &n, "moe_inter", "--moe-inter", SAME, "%lld", (long long)a->moe_inter);
    put(s, &n, "moe_dtype", "--moe-dtype", SAME, "%s",
        a->moe_quant ? kt_moe_quant_name(a->moe_quant) : kt_dtype_name(a->moe_dtype));
    put(s, &n, "moe_group", "--moe-group", SAME, "%d", a->moe_group);
    put(s, &n, "moe_mode", "--moe-mode", SAME, "%s", modes[a->moe_mode]);
    put(s, &n, "lora_rank", "--lora-rank", SAME, "%lld", (long long)a->lora_rank);
    put(s, &n, "lora_alpha", "--lora-alpha", SAME, "%.9g", (double)a->lora_alpha);
    /* kernels are deterministic for a thread count: another one rounds differently */
    put(s, &n, "threads", "--threads", ROUNDING, "%d", kt_threadpool_size(t->pool));
    put(s, &n, "ranks", "the number of ranks", ROUNDING, "%d", t->r.world);
    put(s, &n, "seed", "--seed", RECORD, "%llu", (unsigned long long)a->seed);
    /* the rest only for --resume to take them when they are not given again */
    put(s, &n, "data", "--data", RECORD, "%s", absolute(a->data).s);
    put(s, &n, "eval_data", "--eval-data", RECORD, "%s",
        a->eval_data != NULL ? absolute(a->eval_data).s : "");
    put(s, &n, "eval_every", "--eval-every", RECORD, "%lld", (long long)a->eval_every);
    put(s, &n, "eval_windows", "--eval-windows", RECORD, "%lld", (long long)a->eval_windows);
    put(s, &n, "save_every", "--save-every", RECORD, "%lld", (long long)a->save_every);
    put(s, &n, "keep", "--keep", RECORD, "%lld", (long long)a->keep);
    put(s, &n, "log_every", "--log-every", RECORD, "%lld", (long long)a->log_every);
    return n;
}

uint64_t resume_settings_hash(const trainer *t, const train_args *a)
{
    setting s[MAX_SETTINGS];
    int n = collect(t, a, s);
    uint64_t h = HASH_START;
    for (int i = 0; i < n; i++)
        if (s[i].kind == SAME)
            h = hash_bytes(h, s[i].value, strlen(s[i].value) + 1);
    return h;
}

/* a JSON string: the quotes, \" \\ and control characters escaped */
static void put_string(kt_out_file *f, const char *s)
{
    kt_out_printf(f, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            kt_out_printf(f, "\\%c", c);
        else if (c < 0x20)
            kt_out_printf(f, "\\u%04x", c);
        else
            kt_out_printf(f, "%c", c);
    }
    kt_out_printf(f, "\"");
}

void resume_write_json(const trainer *t, const train_args *a, int64_t step, uint64_t session_bytes,
                       uint64_t session_hash, kt_out_file *f)
{
    setting s[MAX_SETTINGS];
    int n = collect(t, a, s);
    int64_t windows = step * a->accum;
    kt_out_printf(f, "{\n  \"format\": \"" RUN_FORMAT "\",\n  \"step\": %lld,\n", (long long)step);
    kt_out_printf(f, "  \"data_position\": {\"windows\": %lld, \"tokens\": %lld},\n",
                  (long long)windows, (long long)(windows * t->data.window));
    kt_out_printf(f, "  \"random\": {\"seed\": %llu, \"per_step\": \"none: kt-train draws "
                  "random numbers only to initialise the parameters and experts; a step uses "
                  "none (no dropout, no shuffling)\"},\n", (unsigned long long)a->seed);
    kt_out_printf(f, "  \"session\": {\"file\": \"session.safetensors\", \"bytes\": %llu, "
                  "\"fnv1a64\": \"%016llx\"},\n", (unsigned long long)session_bytes,
                  (unsigned long long)session_hash);
    kt_out_printf(f, "  \"program\": {\"file\": \"program.ktp\", \"bytes\": %llu},\n",
                  (unsigned long long)t->program_size);
    kt_out_printf(f, "  \"settings\": {");
    for (int i = 0; i < n; i++) {
        kt_out_printf(f, "%s\n    \"%s\": ", i ? "," : "", s[i].key);
        put_string(f, s[i].value);
    }
    kt_out_printf(f, "\n  }\n}\n");
}

static char *read_json(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    char *buf = malloc(MAX_JSON_BYTES + 1);
    size_t len = buf != NULL ? fread(buf, 1, MAX_JSON_BYTES + 1, f) : 0;
    int bad = buf == NULL || ferror(f) || len > MAX_JSON_BYTES;
    fclose(f);
    if (bad) {
        free(buf);
        errno = EFBIG;
        return NULL;
    }
    *len_out = len;
    return buf;
}

static int get_u64(const flat_json *j, const char *path, uint64_t *out)
{
    const flat_json_field *f = flat_json_get(j, path);
    char *end;
    if (f == NULL || f->is_string || f->value[0] == '-')
        return -1;
    *out = strtoull(f->value, &end, 10);
    return *end == '\0' ? 0 : -1;
}

static int get_hex(const flat_json *j, const char *path, uint64_t *out)
{
    const flat_json_field *f = flat_json_get(j, path);
    char *end;
    if (f == NULL || !f->is_string || strlen(f->value) != 16)
        return -1;
    *out = strtoull(f->value, &end, 16);
    return *end == '\0' ? 0 : -1;
}

/* dir/run.json parsed into *j; 0, or 1 after train_error. */
static int read_run_json(const char *dir, flat_json *j)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/run.json", dir);
    size_t len = 0;
    char *text = read_json(path, &len);
    if (text == NULL)
        return train_error("cannot resume from %s: cannot read its run.json: %s", dir,
                           strerror(errno));
    char why[128];
    int bad = flat_json_parse(text, len, j, why, sizeof why);
    free(text);
    if (bad != 0)
        return train_error("cannot resume from %s: run.json is corrupt: %s", dir, why);
    return 0;
}

int resume_read_settings(const char *resume, flat_json *settings)
{
    static resume_point point; /* some 20 KB: not on the stack */
    if (checkpoint_find(resume, &point) != 0)
        return 1;
    return read_run_json(point.dir, settings);
}

int resume_check(trainer *t, const train_args *a, resume_point *from)
{
    static flat_json j; /* some 60 KB: not on the stack */
    if (read_run_json(from->dir, &j) != 0)
        return 1;
    const flat_json_field *format = flat_json_get(&j, "format");
    uint64_t step, windows;
    if (format == NULL || strcmp(format->value, RUN_FORMAT) != 0 ||
        get_u64(&j, "step", &step) != 0 || get_u64(&j, "data_position.windows", &windows) != 0 ||
        get_u64(&j, "session.bytes", &from->session_bytes) != 0 ||
        get_hex(&j, "session.fnv1a64", &from->session_hash) != 0)
        return train_error("cannot resume from %s: run.json is not a kt-train checkpoint's "
                           "(format \"" RUN_FORMAT "\" with step, data_position, session and "
                           "settings)", from->dir);
    from->step = (int64_t)step;
    from->windows = (int64_t)windows;
    setting s[MAX_SETTINGS];
    int n = collect(t, a, s);
    char diff[1024] = "";
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].kind == RECORD)
            continue;
        char key[FLAT_JSON_PATH];
        snprintf(key, sizeof key, "settings.%s", s[i].key);
        const flat_json_field *f = flat_json_get(&j, key);
        const char *was = f != NULL && f->is_string ? f->value : NULL;
        if (was != NULL && strcmp(was, s[i].value) == 0)
            continue;
        if (s[i].kind == ROUNDING) {
            if (t->r.rank == 0)
                fprintf(stderr, "kt-train: warning: %s is %s here but was %s in %s: the run "
                        "goes on, rounded differently (not bit for bit the same as one that "
                        "did not stop)\n", s[i].what, s[i].value, was ? was : "not recorded",
                        from->dir);
            continue;
        }
        int k = snprintf(diff + used, sizeof diff - used, "%s%s is %s here but %s in the "
                         "checkpoint", used ? "; " : "", s[i].what, s[i].value,
                         was ? was : "not recorded");
        used = k > 0 && used + (size_t)k < sizeof diff ? used + (size_t)k : sizeof diff - 1;
    }
    int rc = 0;
    if (used > 0)
        rc = train_error("cannot resume from %s: %s (resume with the options and files the run "
                         "was started with)", from->dir, diff);
    else if (from->windows != from->step * a->accum)
        rc = train_error("cannot resume from %s: its data position (%lld windows) is not step "
                         "%lld x --accum %lld", from->dir, (long long)from->windows,
                         (long long)from->step, (long long)a->accum);
    else if (from->step > a->steps)
        rc = train_error("cannot resume from %s: it is at step %lld, past --steps %lld",
                         from->dir, (long long)from->step, (long long)a->steps);
    return rc;
}

int resume_load(trainer *t)
{
    resume_point *from = &t->from;
    uint64_t bytes = 0, hash = 0;
    if (checkpoint_hash_file(from->session, &bytes, &hash) != 0)
        return train_error("cannot resume from %s: cannot read %s: %s", from->dir,
                           from->session, strerror(errno));
    if (bytes != from->session_bytes || hash != from->session_hash)
        return train_error("cannot resume from %s: %s is corrupt (%llu bytes%s; run.json says "
                           "%llu bytes with hash %016llx): resume from an earlier checkpoint",
                           from->dir, from->session, (unsigned long long)bytes,
                           bytes == from->session_bytes ? ", another hash" : "",
                           (unsigned long long)from->session_bytes,
                           (unsigned long long)from->session_hash);
    /* the experts and their optimizer state are rank 0's: the other ranks skip them */
    unsigned flags = KT_LOAD_OPTIMIZER | (t->r.rank > 0 ? KT_LOAD_ALLOW_UNUSED : 0u);
    if (kt_session_load(t->s, from->session, flags) != KT_OK)
        return train_error("cannot resume from %s: %s", from->dir, kt_last_error());
    if (kt_session_step_count(t->s) != from->step)
        return train_error("cannot resume from %s: its session is at step %lld, run.json says "
                           "%lld", from->dir, (long long)kt_session_step_count(t->s),
                           (long long)from->step);
    return 0;
}
