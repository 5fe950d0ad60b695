/* Context-parallel attention, run as one rank under kt-launch: every rank builds a model of
 * cp_attention on its two chunks of the sequence and compares with one-rank causal attention
 * on the whole sequence, which it computes itself on a session without a communicator.
 *
 *   cp_attn_rank_test f32 balanced|contiguous   q, k, v trained parameters; loss =
 *       cross_entropy(o as logits): outputs o and lse, dq, dk, dv and the loss equal the
 *       unsharded run's (within 1e-5 of each tensor's largest magnitude) for GQA and MHA,
 *       with and without a sliding window and segment ids, chunks within one kernel block
 *       and across several
 *   cp_attn_rank_test bf16 balanced|contiguous  frozen bf16 q, k, v: o and lse (forward)
 *
 * Prints "PASS rank r" or "FAIL rank r: why" and exits 0/1. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tests/comm/rank_check.h"

typedef struct cp_case {
    const char *name;
    int64_t B, C, Hq, Hkv, D, Dv; /* C: positions of a chunk; a rank holds 2 */
    int64_t window;
    int segments;
} cp_case;

static const cp_case cases[] = {
    {"gqa", 2, 5, 4, 2, 8, 6, 0, 0},
    {"mha window segments", 1, 12, 2, 2, 8, 8, 7, 1},
    {"mqa segments, chunks over kernel blocks", 1, 40, 2, 1, 8, 8, 0, 1},
    {"gqa window 50 over kernel blocks", 2, 36, 4, 2, 4, 4, 50, 0},
};

/* The global position of local position t of rank r (chunks r and 2W-1-r, or 2r and 2r+1). */
static int64_t global_pos(kt_cp_layout layout, int world, int r, int64_t C, int64_t t)
{
    const int64_t ch = t / C;
    const int64_t gc = layout == KT_CP_CONTIGUOUS ? 2 * r + ch : ch == 0 ? r : 2 * world - 1 - r;
    return gc * C + t % C;
}

/* documents of 1..13 positions, different in each batch row, crossing the chunks */
static int64_t segment_at(int64_t b, int64_t pos) { return (pos + 3 * b) / (5 + 4 * b); }

/* q, k, v -> [cp_]attention -> logits [B*T*Hq, Dv] -> cross-entropy (f32, trained), or the
 * frozen bf16 forward. */
static kt_program *model(const cp_case *c, int64_t T, int sharded, kt_cp_layout layout,
                         kt_dtype dt)
{
    kt_graph *g;
    kt_value q, k, v, seg, y, o[2], logits, loss;
    OK(kt_graph_create(&g));
    const int64_t qs[4] = {c->B, T, c->Hq, c->D}, ks[4] = {c->B, T, c->Hkv, c->D};
    const int64_t vs[4] = {c->B, T, c->Hkv, c->Dv};
    if (dt == KT_F32) {
        OK(kt_graph_param(g, "q", dt, 4, qs, kt_init_zeros(), &q));
        OK(kt_graph_param(g, "k", dt, 4, ks, kt_init_zeros(), &k));
        OK(kt_graph_param(g, "v", dt, 4, vs, kt_init_zeros(), &v));
    } else {
        OK(kt_graph_const_param(g, "q", dt, 4, qs, kt_init_zeros(), &q));
        OK(kt_graph_const_param(g, "k", dt, 4, ks, kt_init_zeros(), &k));
        OK(kt_graph_const_param(g, "v", dt, 4, vs, kt_init_zeros(), &v));
    }
    kt_value in[4] = {q, k, v, q}; /* in[3]: the segments, when given */
    int n_in = 3;
    if (c->segments) {
        OK(kt_graph_input(g, "seg", KT_I64, 2, (int64_t[]){c->B, T}, &seg));
        in[3] = seg, n_in = 4;
    }
    if (sharded) {
        kt_op_attrs a = kt_op_defaults(KT_OP_CP_ATTENTION);
        a.attn_window = c->window;
        a.cp_layout = layout;
        OK(kt_graph_op(g, "attn", KT_OP_CP_ATTENTION, &a, in, n_in, o));
    } else {
        kt_op_attrs a = kt_op_defaults(KT_OP_ATTENTION);
        a.attn_causal = 1;
        a.attn_window = c->window;
        OK(kt_graph_op(g, "attn", KT_OP_ATTENTION, &a, in, n_in, o));
    }
    kt_op_attrs rs = kt_op_defaults(KT_OP_RESHAPE);
    rs.ndim = 2, rs.shape[0] = c->B * T * c->Hq, rs.shape[1] = c->Dv;
    OK(kt_graph_op(g, "flat", KT_OP_RESHAPE, &rs, &o[0], 1, &logits));
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_output(g, o[1], "lse"));
    if (dt == KT_F32) {
        OK(kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){c->B * T * c->Hq}, &y));
        kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
        OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){logits, y}, 2, &loss));
        OK(kt_graph_set_loss(g, loss));
    }
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* The values of a tensor [B, T, H, X] (or [B, T]) at the global positions pos[t]. */
static void fill(kt_tensor *t, uint64_t seed, const int64_t *pos, int64_t S)
{
    const int64_t B = t->shape[0], T = t->shape[1];
    const int64_t row = kt_tensor_numel(t) / (B * T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < T; i++)
            for (int64_t x = 0; x < row; x++) {
                const int64_t at = (b * T + i) * row + x, g = (b * S + pos[i]) * row + x;
                const float v = 2.0f * rank_value_at(seed, g);
                if (t->dtype == KT_BF16)
                    ((uint16_t *)t->data)[at] = kt_f32_to_bf16_1(v);
                else
                    ((float *)t->data)[at] = v;
            }
}

static float get_f32(const kt_tensor *t, int64_t i)
{
    return t->dtype == KT_BF16 ? kt_bf16_to_f32_1(((const uint16_t *)t->data)[i])
                               : ((const float *)t->data)[i];
}

typedef struct run {
    kt_session *s;
    float loss;
} run;

static run run_model(kt_program *p, kt_comm *comm, const cp_case *c, const int64_t *pos,
                     int64_t T, int64_t S)
{
    run r;
    kt_session_options so = {.threads = 2, .comm = comm, .optimizer = {.kind = KT_OPTIM_NONE}};
    OK(kt_session_create(p, &so, &r.s));
    const char *names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        kt_tensor t;
        OK(kt_session_tensor(r.s, KT_ROLE_PARAM, names[i], &t));
        fill(&t, 10 + (uint64_t)i, pos, S);
    }
    kt_tensor t;
    if (c->segments) {
        OK(kt_session_tensor(r.s, KT_ROLE_INPUT, "seg", &t));
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t i = 0; i < T; i++)
                ((int64_t *)t.data)[b * T + i] = segment_at(b, pos[i]);
    }
    r.loss = 0;
    if (kt_session_tensor(r.s, KT_ROLE_INPUT, "y", &t) == KT_OK) {
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t i = 0; i < T; i++)
                for (int64_t h = 0; h < c->Hq; h++)
                    ((int32_t *)t.data)[(b * T + i) * c->Hq + h] =
                        (int32_t)(((b * S + pos[i]) * c->Hq + h) * 7 % c->Dv);
        OK(kt_session_forward(r.s));
        OK(kt_session_backward(r.s));
    } else {
        OK(kt_session_forward(r.s));
    }
    return r;
}

/* max |a - b| over this rank's elements, relative to the whole tensor's largest |b|: a is the
 * rank's [B, T, X] (factor f applied), b the whole [B, S, X]; lse's [B, H, T] layout with
 * lse_rows = H. */
static double compare(const kt_tensor *a, const kt_tensor *b, const int64_t *pos, int64_t B,
                      int64_t T, int64_t S, int64_t lse_rows, double f)
{
    double scale = 1e-12, err = 0;
    for (int64_t i = 0; i < kt_tensor_numel(b); i++)
        scale = fmax(scale, fabs((double)get_f32(b, i)));
    const int64_t H = lse_rows ? lse_rows : 1;
    const int64_t x = lse_rows ? 1 : kt_tensor_numel(a) / (B * T);
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++)
                for (int64_t e = 0; e < x; e++) {
                    const int64_t ia = ((bb * H + h) * T + i) * x + e;
                    const int64_t ib = ((bb * H + h) * S + pos[i]) * x + e;
                    err = fmax(err, fabs(f * (double)get_f32(a, ia) - (double)get_f32(b, ib)));
                }
    return err / scale;
}

static kt_tensor tensor(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    return t;
}

static void scenario(kt_comm *comm, kt_dtype dt, kt_cp_layout layout)
{
    const int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    const double bound = dt == KT_F32 ? 1e-5 : 1e-2; /* bf16: o rounded once either way */
    double worst = 0;
    for (size_t n = 0; n < sizeof cases / sizeof cases[0]; n++) {
        const cp_case *c = &cases[n];
        const int64_t T = 2 * c->C, S = T * world;
        int64_t *pos = malloc((size_t)S * sizeof *pos), *all = malloc((size_t)S * sizeof *all);
        if (pos == NULL || all == NULL)
            rank_fail("out of memory");
        for (int64_t i = 0; i < T; i++)
            pos[i] = global_pos(layout, world, rank, c->C, i);
        for (int64_t i = 0; i < S; i++)
            all[i] = i;
        kt_program *ps = model(c, T, 1, layout, dt), *pw = model(c, S, 0, layout, dt);
        run a = run_model(ps, comm, c, pos, T, S), b = run_model(pw, NULL, c, all, S, S);
        double e[6] = {0};
        kt_tensor la = tensor(a.s, KT_ROLE_OUTPUT, "logits"), lb = tensor(b.s, KT_ROLE_OUTPUT, "logits");
        kt_tensor sa = tensor(a.s, KT_ROLE_OUTPUT, "lse"), sb = tensor(b.s, KT_ROLE_OUTPUT, "lse");
        e[0] = compare(&la, &lb, pos, c->B, T, S, 0, 1.0);
        e[1] = compare(&sa, &sb, pos, c->B, T, S, c->Hq, 1.0);
        const char *names[3] = {"q", "k", "v"};
        if (dt == KT_F32) {
            /* each rank's loss is its tokens' mean: its gradients are W times the whole
             * run's (the session's step averages the replicated parameters' over the ranks) */
            for (int i = 0; i < 3; i++) {
                kt_tensor ga = tensor(a.s, KT_ROLE_GRAD, names[i]);
                kt_tensor gb = tensor(b.s, KT_ROLE_GRAD, names[i]);
                e[2 + i] = compare(&ga, &gb, pos, c->B, T, S, 0, 1.0 / world);
            }
            OK(kt_session_step(a.s)); /* averages the loss over the ranks */
            OK(kt_session_step(b.s));
            const double l0 = kt_session_loss(a.s), l1 = kt_session_loss(b.s);
            e[5] = fabs(l0 - l1) / fmax(fabs(l1), 1e-12);
        }
        for (int i = 0; i < 6; i++)
            worst = fmax(worst, e[i]);
        if (!(e[0] <= bound && e[1] <= bound && e[2] <= bound && e[3] <= bound &&
              e[4] <= bound && e[5] <= bound))
            rank_fail("%s %s %s: relative errors o %.3g, lse %.3g, dq %.3g, dk %.3g, dv %.3g, "
                 "loss %.3g (bound %g)",
                 c->name, kt_dtype_name(dt), layout == KT_CP_BALANCED ? "balanced" : "contiguous",
                 e[0], e[1], e[2], e[3], e[4], e[5], bound);
        kt_session_destroy(a.s);
        kt_session_destroy(b.s);
        kt_program_destroy(ps);
        kt_program_destroy(pw);
        free(pos), free(all);
    }
    printf("PASS rank %d: cp_attention %s %s, %zu cases over %d ranks (%s), worst relative "
           "error %.3g\n",
           rank, kt_dtype_name(dt), layout == KT_CP_BALANCED ? "balanced" : "contiguous",
           sizeof cases / sizeof cases[0], world,
           dt == KT_F32 ? "o, lse, dq, dk, dv, loss" : "frozen: o, lse", worst);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: cp_attn_rank_test f32|bf16 balanced|contiguous\n");
        return 2;
    }
    kt_comm *comm;
    kt_status s = kt_comm_create_ucx(NULL, &comm);
    if (s != KT_OK)
        rank_fail("kt_comm_create_ucx: %s", kt_last_error());
    rank_id = kt_comm_rank(comm);
    const kt_dtype dt = strcmp(argv[1], "bf16") == 0 ? KT_BF16 : KT_F32;
    const kt_cp_layout layout =
        strcmp(argv[2], "contiguous") == 0 ? KT_CP_CONTIGUOUS : KT_CP_BALANCED;
    scenario(comm, dt, layout);
    fflush(stdout);
    kt_comm_destroy(comm);
    return 0;
}
