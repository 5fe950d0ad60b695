/* The moe op over several ranks, run as one rank under kt-launch: every rank builds its part
 * and compares with the one-rank run on the concatenated batch, which it computes itself.
 *
 *   ep_rank_test varlen rank0|ep   ranks bring different row counts (one of them none):
 *                                   outputs, grad_x (through a scale parameter before the
 *                                   layer), the routing-weight gradients (through the router)
 *                                   and the experts' weight gradients equal one rank's
 *   ep_rank_test train rank0|ep MODE [map]
 *                                   several AdamW steps (MODE full, lora or frozen): losses and
 *                                   every parameter (the graph's, the experts' or adapters'
 *                                   on their owner) equal one rank's; the experts split in
 *                                   consecutive ranges of E/W (E = 7, not divisible by 2, 3
 *                                   or 4) or, with `map`, expert g on rank g % W; in ep,
 *                                   every rank saves its session and resumes a fresh share
 *                                   from it (optimizer state too: one more step equal) and
 *                                   from the one-rank session's file (its experts by name)
 *
 * Prints "PASS rank r ..." or "FAIL rank r: why" and exits 0/1. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include <kt/kt.h>

#include "tests/comm/rank_check.h"

static void fill(float *v, int64_t n, uint64_t seed, int64_t offset, float scale)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = scale * rank_value_at(seed, i + offset);
}

/* max |a - b| over the largest |b| (the bound of the house rules) */
static double rel_err(const float *a, const float *b, int64_t n)
{
    double scale = 1e-12, err = 0;
    for (int64_t i = 0; i < n; i++)
        scale = fmax(scale, fabs((double)b[i]));
    for (int64_t i = 0; i < n; i++)
        err = fmax(err, fabs((double)a[i] - (double)b[i]));
    return err / scale;
}

static void expect(const char *what, const float *a, const float *b, int64_t n, double bound)
{
    double e = rel_err(a, b, n);
    if (!(e <= bound))
        rank_fail("%s: relative error %.3g (bound %g)", what, e, bound);
}

static float *scaled_copy(const float *v, int64_t n, float s)
{
    float *o = malloc((size_t)(n > 0 ? n : 1) * sizeof *o);
    if (o == NULL)
        rank_fail("out of memory");
    for (int64_t i = 0; i < n; i++)
        o[i] = v[i] * s;
    return o;
}

enum { H = 16, I = 12, E = 7, K = 2, STEPS = 3 };

/* ---- the model: h = x * s; ids, w = topk(h @ router); m = moe(h, ids, w); the loss ----------
 * sum_loss: sum(m * c) (each token's gradient is c's row whatever the rank's row count, so
 * ranks of different counts can be compared with one rank); else cross-entropy of m. */
static kt_program *model(int64_t t, kt_moe_parallel par, int sum_loss)
{
    kt_graph *g;
    kt_value x, y, c, s, r, h, logits, route[2], m, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){t, H}, &x));
    OK(kt_graph_param(g, "s", KT_F32, 1, (int64_t[]){H}, kt_init_zeros(), &s));
    OK(kt_graph_param(g, "router", KT_F32, 2, (int64_t[]){H, E}, kt_init_zeros(), &r));
    OK(kt_graph_op(g, "scale", KT_OP_MUL, NULL, (kt_value[]){x, s}, 2, &h));
    OK(kt_graph_op(g, "route", KT_OP_MATMUL, NULL, (kt_value[]){h, r}, 2, &logits));
    kt_op_attrs ra = kt_op_defaults(KT_OP_TOPK_ROUTER);
    ra.k = K;
    ra.norm_topk = 1;
    OK(kt_graph_op(g, "topk", KT_OP_TOPK_ROUTER, &ra, &logits, 1, route));
    kt_op_attrs ma = kt_op_defaults(KT_OP_MOE);
    ma.moe_parallel = par;
    OK(kt_graph_op(g, "moe", KT_OP_MOE, &ma, (kt_value[]){h, route[0], route[1]}, 3, &m));
    OK(kt_graph_output(g, m, "m"));
    if (sum_loss) {
        kt_value p, p1;
        OK(kt_graph_input(g, "c", KT_F32, 2, (int64_t[]){t, H}, &c));
        OK(kt_graph_op(g, "prod", KT_OP_MUL, NULL, (kt_value[]){m, c}, 2, &p));
        kt_op_attrs sa = kt_op_defaults(KT_OP_SUM);
        sa.dim = 0;
        OK(kt_graph_op(g, "sum0", KT_OP_SUM, &sa, &p, 1, &p1));
        OK(kt_graph_op(g, "sum1", KT_OP_SUM, &sa, &p1, 1, &loss));
    } else {
        OK(kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){t}, &y));
        kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
        ce.ignore_index = -100;
        OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){m, y}, 2, &loss));
    }
    OK(kt_graph_set_loss(g, loss));
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* expert g's weights, the same in the whole layer and in a share */
static void set_expert(kt_moe *m, int64_t local, int64_t g)
{
    for (int p = 0; p < 3; p++) {
        kt_tensor w;
        OK(kt_moe_weight(m, local, (kt_moe_proj)p, &w));
        fill(w.data, kt_tensor_numel(&w), 100 + (uint64_t)(g * 3 + p), 0, 0.5f);
    }
}

/* The layer of the model's experts ids[0..n) (ids NULL: all E, top_k K). */
static kt_moe *make_layer(const int64_t *ids, int64_t n, int64_t max_tokens, kt_moe_mode mode)
{
    kt_moe_config c = {.n_experts = ids ? n : E, .hidden = H, .intermediate = I,
                       .top_k = ids ? 1 : K, .max_tokens = max_tokens, .weight_dtype = KT_F32,
                       .act_dtype = KT_F32, .mode = mode, .lora_rank = 4, .lora_alpha = 8.0f,
                       .keep_activations = 1, .name = ids ? "share" : "whole", .expert_ids = ids};
    kt_moe *m;
    OK(kt_moe_create(&c, NULL, &m));
    for (int64_t e = 0; e < c.n_experts; e++)
        set_expert(m, e, ids ? ids[e] : e);
    return m;
}

/* This rank's experts: a consecutive range of E/W (the first E % W ranks one more), or g % W. */
static int64_t my_experts(int rank, int world, int map, int64_t *ids)
{
    int64_t n = 0, first = 0;
    for (int r = 0; r < rank; r++)
        first += E / world + (r < E % world);
    for (int64_t g = 0; g < E; g++)
        if (map ? g % world == rank : g >= first && g < first + E / world + (rank < E % world))
            ids[n++] = g;
    return n;
}

typedef struct run {
    kt_program *p;
    kt_session *s;
    int64_t t, offset; /* rows, and where they start in the concatenated batch */
} run;

static void start(run *r, kt_program *p, kt_comm *comm, kt_moe *layer, int64_t t, int64_t offset,
                  kt_optimizer_kind opt, float clip)
{
    r->p = p;
    r->t = t;
    r->offset = offset;
    kt_moe *layers[1] = {layer};
    kt_session_options so = {.threads = 1, .comm = comm, .moe_layers = layers,
                             .n_moe_layers = 1,
                             .optimizer = {.kind = opt, .lr = 2e-2f, .clip_norm = clip}};
    OK(kt_session_create(p, &so, &r->s));
    kt_tensor s, router;
    OK(kt_session_tensor(r->s, KT_ROLE_PARAM, "s", &s));
    OK(kt_session_tensor(r->s, KT_ROLE_PARAM, "router", &router));
    fill(s.data, H, 2, 0, 1.0f);
    fill(router.data, H * E, 3, 0, 1.0f);
}

/* the batch of step `step`: this run's rows of the concatenated one */
static void feed(run *r, int step, int sum_loss)
{
    kt_tensor x, y, c;
    OK(kt_session_tensor(r->s, KT_ROLE_INPUT, "x", &x));
    fill(x.data, r->t * H, 10 + (uint64_t)step, r->offset * H, 1.0f);
    if (sum_loss) {
        OK(kt_session_tensor(r->s, KT_ROLE_INPUT, "c", &c));
        fill(c.data, r->t * H, 20 + (uint64_t)step, r->offset * H, 1.0f);
    } else {
        OK(kt_session_tensor(r->s, KT_ROLE_INPUT, "y", &y));
        for (int64_t i = 0; i < r->t; i++)
            ((int32_t *)y.data)[i] = (int32_t)((i + r->offset) * 5 % H + step) % H;
    }
}

static const float *tensor_of(run *r, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(r->s, role, name, &t));
    return t.data;
}

/* The experts' trained tensors of the share (local e = model's g) against the whole layer's:
 * full mode the weights or their gradients, LoRA the adapters or theirs. grad_scale scales the
 * share's gradients before the comparison. */
static void expect_experts(const char *when, kt_moe *share, const int64_t *ids, int64_t n,
                           kt_moe *whole, kt_moe_mode mode, int grads, float grad_scale)
{
    char what[128];
    for (int64_t e = 0; e < n; e++)
        for (int p = 0; p < 3; p++)
            for (int b = 0; b < (mode == KT_MOE_LORA ? 2 : 1); b++) {
                kt_tensor a, w;
                if (mode == KT_MOE_FULL && grads) {
                    OK(kt_moe_weight_grad(share, e, (kt_moe_proj)p, &a));
                    OK(kt_moe_weight_grad(whole, ids[e], (kt_moe_proj)p, &w));
                } else if (mode == KT_MOE_FULL || mode == KT_MOE_FROZEN) {
                    OK(kt_moe_weight(share, e, (kt_moe_proj)p, &a));
                    OK(kt_moe_weight(whole, ids[e], (kt_moe_proj)p, &w));
                } else if (grads) {
                    OK(kt_moe_lora_grad(share, e, (kt_moe_proj)p, b, &a));
                    OK(kt_moe_lora_grad(whole, ids[e], (kt_moe_proj)p, b, &w));
                } else {
                    OK(kt_moe_lora(share, e, (kt_moe_proj)p, b, &a));
                    OK(kt_moe_lora(whole, ids[e], (kt_moe_proj)p, b, &w));
                }
                snprintf(what, sizeof what, "%s: expert %lld proj %d %s%s", when,
                         (long long)ids[e], p, mode == KT_MOE_LORA ? (b ? "lora B " : "lora A ") : "",
                         grads ? "gradient" : "value");
                float *sa = scaled_copy(a.data, kt_tensor_numel(&a), grads ? grad_scale : 1.0f);
                expect(what, sa, w.data, kt_tensor_numel(&w), 1e-5);
                free(sa);
            }
}

static kt_moe_parallel parse_par(const char *s)
{
    if (strcmp(s, "ep") == 0)
        return KT_MOE_PARALLEL_EP;
    if (strcmp(s, "rank0") != 0)
        rank_fail("unknown parallel mode %s (rank0 or ep)", s);
    return KT_MOE_PARALLEL_RANK0;
}

/* ---- varlen --------------------------------------------------------------------------------- */

static int64_t rows_of(int rank) { return (int64_t[]){5, 0, 7, 3}[rank % 4]; }

static void scenario_varlen(kt_comm *comm, kt_moe_parallel par)
{
    const int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    const int ep = par == KT_MOE_PARALLEL_EP;
    int64_t total = 0, offset = 0;
    for (int r = 0; r < world; r++) {
        offset += r < rank ? rows_of(r) : 0;
        total += rows_of(r);
    }
    const int64_t t = rows_of(rank);
    int64_t ids[E], n = ep ? my_experts(rank, world, 0, ids) : 0;
    kt_moe *whole = make_layer(NULL, 0, total, KT_MOE_FULL);
    kt_moe *mine = ep ? make_layer(ids, n, total * K, KT_MOE_FULL)
                      : rank == 0 ? make_layer(NULL, 0, total, KT_MOE_FULL) : NULL;
    if (!ep && rank == 0)
        for (int64_t g = 0; g < E; g++)
            ids[n++] = g;
    run a, b;
    start(&a, model(t, par, 1), comm, mine, t, offset, KT_OPTIM_NONE, 0.0f);
    start(&b, model(total, KT_MOE_PARALLEL_RANK0, 1), NULL, whole, total, 0, KT_OPTIM_NONE, 0.0f);
    run *both[2] = {&a, &b};
    for (int i = 0; i < 2; i++) {
        feed(both[i], 0, 1);
        OK(kt_session_forward(both[i]->s));
        OK(kt_session_backward(both[i]->s));
        OK(kt_session_step(both[i]->s)); /* no update: the gradients averaged over the ranks */
    }
    /* each rank's loss is the sum over its rows and the ranks average: one rank's sum is W
     * times the mean, and so are its gradients */
    const float w = (float)world;
    expect("output rows", tensor_of(&a, KT_ROLE_OUTPUT, "m"),
           tensor_of(&b, KT_ROLE_OUTPUT, "m") + offset * H, t * H, 1e-5);
    float la = kt_session_loss(a.s) * w, lb = kt_session_loss(b.s);
    expect("loss", &la, &lb, 1, 1e-5);
    float *gs = scaled_copy(tensor_of(&a, KT_ROLE_GRAD, "s"), H, w);
    expect("grad s (the layer's grad_x)", gs, tensor_of(&b, KT_ROLE_GRAD, "s"), H, 1e-5);
    float *gr = scaled_copy(tensor_of(&a, KT_ROLE_GRAD, "router"), H * E, w);
    expect("grad router (the routing-weight gradients)", gr,
           tensor_of(&b, KT_ROLE_GRAD, "router"), H * E, 1e-5);
    if (mine != NULL)
        expect_experts("varlen", mine, ids, n, whole, KT_MOE_FULL, 1, w);
    free(gs), free(gr);
    for (int i = 0; i < 2; i++) {
        kt_session_destroy(both[i]->s);
        kt_program_destroy(both[i]->p);
    }
    kt_moe_destroy(mine), kt_moe_destroy(whole);
    printf("PASS rank %d: varlen %s over %d ranks (%lld of %lld rows here, %lld experts here)\n",
           rank, ep ? "ep" : "rank0", world, (long long)t, (long long)total, (long long)n);
}

/* ---- training steps -------------------------------------------------------------------------- */

enum { TT = 4 };

/* Saving sharded experts: every rank saves its session (its share, the replicated parameters
 * and the optimizer state); a fresh session with a fresh share resumes from that file, and
 * another from the one-rank session's file (the whole layer: the share takes its experts by
 * name); both equal the trained run, and one more step of the resumed share equals one more
 * step of the one-rank run. */
static void check_resume(run *a, run *b, kt_comm *comm, const int64_t *ids, int64_t n,
                         kt_moe_mode mode, kt_moe *whole)
{
    const int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    char mine_path[128], whole_path[128];
    const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(mine_path, sizeof mine_path, "%s/ep_rank_test.%d.%d.safetensors", dir,
             (int)getppid(), rank);
    snprintf(whole_path, sizeof whole_path, "%s/ep_rank_test.%d.%d.whole.safetensors", dir,
             (int)getppid(), rank);
    OK(kt_session_save(a->s, mine_path, 1));
    OK(kt_session_save(b->s, whole_path, 0));
    for (int from_whole = 0; from_whole < 2; from_whole++) {
        kt_moe *fresh = make_layer(ids, n, TT * world * K, mode);
        run r;
        start(&r, a->p, comm, fresh, TT, rank * TT, KT_OPTIM_ADAMW, 0.5f);
        /* a layer's optimizer state is one flat span: it resumes from the same placement only */
        OK(kt_session_load(r.s, from_whole ? whole_path : mine_path,
                           from_whole ? 0u : KT_LOAD_OPTIMIZER));
        const char *what = from_whole ? "resumed from the one-rank file" : "resumed from its shard";
        expect(what, tensor_of(&r, KT_ROLE_PARAM, "router"), tensor_of(b, KT_ROLE_PARAM, "router"),
               H * E, 1e-5);
        expect_experts(what, fresh, ids, n, whole, mode, 0, 1.0f);
        if (!from_whole) {
            /* one more step each: the shard's optimizer state came back too */
            feed(&r, STEPS, 0);
            feed(b, STEPS, 0);
            OK(kt_session_forward(r.s));
            OK(kt_session_backward(r.s));
            OK(kt_session_forward(b->s));
            OK(kt_session_backward(b->s));
            OK(kt_session_step(r.s));
            OK(kt_session_step(b->s));
            expect_experts("a step after resuming", fresh, ids, n, whole, mode, 0, 1.0f);
            expect("the router a step after resuming", tensor_of(&r, KT_ROLE_PARAM, "router"),
                   tensor_of(b, KT_ROLE_PARAM, "router"), H * E, 1e-5);
        }
        kt_session_destroy(r.s);
        kt_moe_destroy(fresh);
        /* the one-rank run has stepped once more: the whole-layer file is from before */
        if (!from_whole)
            OK(kt_session_save(b->s, whole_path, 0));
    }
    unlink(mine_path);
    unlink(whole_path);
}

static void scenario_train(kt_comm *comm, kt_moe_parallel par, kt_moe_mode mode, int map)
{
    const int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    const int ep = par == KT_MOE_PARALLEL_EP;
    const int64_t total = TT * world;
    int64_t ids[E], n = ep ? my_experts(rank, world, map, ids) : 0;
    kt_moe *whole = make_layer(NULL, 0, total, mode);
    kt_moe *mine = ep ? make_layer(ids, n, total * K, mode)
                      : rank == 0 ? make_layer(NULL, 0, total, mode) : NULL;
    if (!ep && rank == 0)
        for (int64_t g = 0; g < E; g++)
            ids[n++] = g;
    run a, b;
    start(&a, model(TT, par, 0), comm, mine, TT, rank * TT, KT_OPTIM_ADAMW, 0.5f);
    start(&b, model(total, KT_MOE_PARALLEL_RANK0, 0), NULL, whole, total, 0, KT_OPTIM_ADAMW, 0.5f);
    run *both[2] = {&a, &b};
    for (int step = 0; step < STEPS; step++) {
        for (int i = 0; i < 2; i++) {
            feed(both[i], step, 0);
            OK(kt_session_forward(both[i]->s));
            OK(kt_session_backward(both[i]->s));
        }
        char when[64];
        snprintf(when, sizeof when, "step %d", step);
        if (mine != NULL && mode != KT_MOE_FROZEN)
            expect_experts(when, mine, ids, n, whole, mode, 1, 1.0f);
        for (int i = 0; i < 2; i++)
            OK(kt_session_step(both[i]->s));
        float la = kt_session_loss(a.s), lb = kt_session_loss(b.s);
        snprintf(when, sizeof when, "step %d loss", step);
        expect(when, &la, &lb, 1, 1e-5);
        float na = kt_session_grad_norm(a.s), nb = kt_session_grad_norm(b.s);
        snprintf(when, sizeof when, "step %d gradient norm", step);
        expect(when, &na, &nb, 1, 1e-5);
    }
    expect("s after the steps", tensor_of(&a, KT_ROLE_PARAM, "s"), tensor_of(&b, KT_ROLE_PARAM, "s"),
           H, 1e-5);
    expect("router after the steps", tensor_of(&a, KT_ROLE_PARAM, "router"),
           tensor_of(&b, KT_ROLE_PARAM, "router"), H * E, 1e-5);
    if (mine != NULL)
        expect_experts("after the steps", mine, ids, n, whole, mode, 0, 1.0f);
    if (ep)
        check_resume(&a, &b, comm, ids, n, mode, whole);
    for (int i = 0; i < 2; i++) {
        kt_session_destroy(both[i]->s);
        kt_program_destroy(both[i]->p);
    }
    kt_moe_destroy(mine), kt_moe_destroy(whole);
    static const char *const modes[] = {"frozen", "lora", "full"};
    printf("PASS rank %d: train %s %s%s over %d ranks, %d AdamW steps (%lld experts here)\n",
           rank, ep ? "ep" : "rank0", modes[mode], map ? " map" : "", world, STEPS,
           (long long)n);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: ep_rank_test varlen rank0|ep | train rank0|ep full|lora|frozen "
                        "[map]\n");
        return 2;
    }
    kt_comm *comm;
    kt_status s = kt_comm_create_ucx(NULL, &comm);
    if (s != KT_OK)
        rank_fail("kt_comm_create_ucx: %s", kt_last_error());
    rank_id = kt_comm_rank(comm);
    kt_moe_parallel par = parse_par(argv[2]);
    if (strcmp(argv[1], "varlen") == 0) {
        scenario_varlen(comm, par);
    } else if (strcmp(argv[1], "train") == 0 && argc > 3) {
        kt_moe_mode mode = strcmp(argv[3], "lora") == 0     ? KT_MOE_LORA
                           : strcmp(argv[3], "frozen") == 0 ? KT_MOE_FROZEN
                                                            : KT_MOE_FULL;
        scenario_train(comm, par, mode, argc > 4 && strcmp(argv[4], "map") == 0);
    } else {
        rank_fail("unknown scenario %s", argv[1]);
    }
    fflush(stdout);
    kt_comm_destroy(comm);
    return 0;
}
