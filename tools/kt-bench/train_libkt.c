/* kt-bench train's libkt side, in a forked child: what kt-train does with a program, through
 * the public API only: the MoE layers (kt_moe_layers_create, initialised from the seed or
 * loaded with the checkpoint), a session with AdamW, and steps of forward, backward and the
 * optimizer on windows of random token ids. The child's peak RSS is then the run's own. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-bench/bench.h"
#include "tools/kt-bench/bench_train.h"

static const char *const tool = "kt-bench train";

static int fail(const char *what)
{
    fprintf(stderr, "%s: libkt: %s: %s\n", tool, what, kt_last_error());
    return 1;
}

typedef struct feed {
    kt_tensor view;
    int kind; /* 0 token ids, 1 labels (the ids, unshifted), 2 targets (the next ids), 3 zeros */
} feed;

#define MAX_FEEDS 8

/* The program's inputs, each fed by its name as kt-train feeds it. */
static int find_feeds(const kt_program *p, kt_session *s, feed *f, int *n, int64_t *bound)
{
    *n = kt_program_count(p, KT_ROLE_INPUT);
    *bound = -1;
    if (*n > MAX_FEEDS) {
        fprintf(stderr, "%s: the program has %d inputs (at most %d)\n", tool, *n, MAX_FEEDS);
        return 1;
    }
    for (int i = 0; i < *n; i++) {
        const char *name;
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, &meta) != KT_OK ||
            kt_session_tensor(s, KT_ROLE_INPUT, name, &f[i].view) != KT_OK)
            return fail("the program's inputs");
        f[i].kind = strcmp(name, "tokens") == 0 || strcmp(name, "input_ids") == 0 ? 0
                  : strcmp(name, "labels") == 0                                  ? 1
                  : strcmp(name, "targets") == 0                                 ? 2
                  : strcmp(name, "segments") == 0                                ? 3
                                                                                 : -1;
        if (f[i].kind < 0 || (meta.dtype != KT_I32 && meta.dtype != KT_I64)) {
            fprintf(stderr, "%s: program input '%s': kt-bench train feeds i32 or i64 inputs "
                    "named tokens or input_ids, labels, targets and segments\n", tool, name);
            return 1;
        }
        if (f[i].kind == 0 && kt_program_index_bound(p, name, bound) != KT_OK)
            return fail("the token input's bound");
    }
    if (*bound < 1) {
        fprintf(stderr, "%s: the program has no token input (tokens or input_ids) with a "
                "vocabulary\n", tool);
        return 1;
    }
    return 0;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static void set_id(kt_tensor *t, int64_t i, int64_t v)
{
    if (t->dtype == KT_I64)
        ((int64_t *)t->data)[i] = v;
    else
        ((int32_t *)t->data)[i] = (int32_t)v;
}

/* A window of random ids: row r of the token input holds ids r*(T+1) .. r*(T+1)+T-1 of a
 * stream, the targets the ids after them (as kt-train reads a file). */
static void fill(feed *f, int n, int64_t bound, uint64_t *rng, int64_t *ids, int64_t count)
{
    for (int64_t i = 0; i < count; i++)
        ids[i] = (int64_t)(rng_next(rng) % (uint64_t)bound);
    int64_t T = 1;
    for (int i = 0; i < n; i++)
        if (f[i].kind == 0)
            T = f[i].view.shape[f[i].view.ndim - 1];
    for (int i = 0; i < n; i++) {
        const int64_t numel = kt_tensor_numel(&f[i].view);
        for (int64_t j = 0; j < numel; j++) {
            const int64_t r = j / T, t = j % T;
            set_id(&f[i].view, j, f[i].kind == 3 ? 0 : ids[r * (T + 1) + t + (f[i].kind == 2)]);
        }
    }
}

static int64_t trainable(const kt_program *p, const kt_moe_layers *m)
{
    int64_t n = 0;
    for (int i = 0; i < kt_program_count(p, KT_ROLE_GRAD); i++) {
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_GRAD, i, NULL, &meta) == KT_OK)
            n += kt_tensor_numel(&meta);
    }
    for (int b = 0; b < m->n; b++) {
        const kt_moe_config *c = m->layers[b] ? kt_moe_get_config(m->layers[b]) : NULL;
        if (c == NULL)
            continue;
        const int64_t E = c->n_experts, H = c->hidden, I = c->intermediate;
        n += c->mode == KT_MOE_FULL ? E * 3 * H * I
           : c->mode == KT_MOE_LORA ? E * 3 * c->lora_rank * (H + I)
                                    : 0;
    }
    return n;
}

static int train(const train_job *j, kt_threadpool *pool, kt_moe_layers *moe, kt_session **s)
{
    const kt_program *p = j->program;
    kt_moe_layers_options mo = {.weight_dtype = j->moe_dtype, .mode = j->moe_mode,
                                .lora_rank = j->lora_rank, .lora_alpha = j->lora_alpha,
                                .intermediate = j->moe_inter, .quant = j->moe_quant,
                                .quant_group = j->moe_group};
    if (kt_moe_layers_create(p, &mo, pool, moe) != KT_OK)
        return fail("the MoE layers");
    if (j->params == NULL && kt_moe_layers_init(moe, j->seed) != KT_OK)
        return fail("the experts' initial weights");
    kt_session_options so = {.pool = pool, .seed = j->seed,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = j->lr},
                             .moe_layers = moe->layers, .n_moe_layers = moe->n};
    if (kt_session_create(p, &so, s) != KT_OK)
        return fail("the session");
    if (j->params != NULL && kt_session_load(*s, j->params, KT_LOAD_ALLOW_INITIALISED) != KT_OK)
        return fail("the checkpoint");
    feed f[MAX_FEEDS];
    int n;
    int64_t bound;
    if (find_feeds(p, *s, f, &n, &bound) != 0)
        return 1;
    int64_t tokens = 0, rows = 1, T = 1;
    for (int i = 0; i < n; i++)
        if (f[i].kind == 0) {
            tokens = kt_tensor_numel(&f[i].view);
            T = f[i].view.shape[f[i].view.ndim - 1];
            rows = tokens / T;
        }
    int64_t *ids = malloc(sizeof *ids * (size_t)(rows * (T + 1)));
    double *times = malloc(sizeof *times * (size_t)j->steps);
    if (ids == NULL || times == NULL) {
        free(ids), free(times);
        fprintf(stderr, "%s: out of memory\n", tool);
        return 1;
    }
    uint64_t rng = j->seed * 0x9E3779B97F4A7C15ull + 7;
    float first = 0, last = 0;
    int rc = 0;
    for (int step = 0; step < j->warmup + j->steps && rc == 0; step++) {
        fill(f, n, bound, &rng, ids, rows * (T + 1));
        const double t0 = bench_now_s();
        if (kt_session_forward(*s) != KT_OK || kt_session_backward(*s) != KT_OK ||
            kt_session_step(*s) != KT_OK) {
            rc = fail("a training step");
            break;
        }
        const double dt = bench_now_s() - t0;
        last = kt_session_loss(*s);
        if (step == 0)
            first = last;
        if (step >= j->warmup)
            times[step - j->warmup] = dt;
    }
    if (rc == 0) {
        const double med = bench_median(times, j->steps);
        printf("{\"tokens_per_s\": %.3f, \"step_ms\": %.3f, \"trainable_params\": %lld, "
               "\"losses\": [%.6g, %.6g], \"threads\": %d}\n",
               (double)tokens / med, med * 1e3, (long long)trainable(p, moe), (double)first,
               (double)last, kt_threadpool_size(pool));
    }
    free(ids);
    free(times);
    return rc;
}

int train_libkt_child(void *job)
{
    const train_job *j = job;
    kt_threadpool *pool = NULL;
    kt_moe_layers moe;
    memset(&moe, 0, sizeof moe);
    kt_session *s = NULL;
    int rc = kt_threadpool_create(j->threads, &pool) != KT_OK ? fail("the thread pool")
                                                              : train(j, pool, &moe, &s);
    kt_session_destroy(s);
    kt_moe_layers_destroy(&moe);
    kt_threadpool_destroy(pool);
    return rc;
}
