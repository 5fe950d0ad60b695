/* The MoE layer inside graphs: the moe op against the layer called directly, checkpointing
 * with the MoE output kept (no expert FLOPs recomputed) or recomputed through the forward
 * cache, and failure injection: a failed recompute poisons the cache, the next step reports
 * it naming the layer, and the step after works again. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "graph/program_internal.h"
#include "graph/runtime/session_internal.h"
#include "lib/moe/moe_internal.h"
#include "tests/support/test_util.h"

enum { T = 12, H = 32, I = 24, E = 6, K = 2, V = 5, MAX_LAYERS = 4 };

/* A frozen bf16 expert layer with seeded weights (the same seed gives the same layer),
 * keeping its intermediates for backward or (keep 0) recomputing them there. */
static kt_moe *make_layer_keeping(uint64_t seed, int keep)
{
    kt_moe_config c = {.n_experts = E,
                       .hidden = H,
                       .intermediate = I,
                       .top_k = K,
                       .max_tokens = T,
                       .weight_dtype = KT_BF16,
                       .act_dtype = KT_F32,
                       .mode = KT_MOE_FROZEN,
                       .keep_activations = keep,
                       .name = "layer"};
    kt_moe *m;
    OK(kt_moe_create(&c, NULL, &m));
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w;
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &w));
            tu_fill_uniform(&w, &rng, -0.3, 0.3);
        }
    return m;
}

static kt_moe *make_layer(uint64_t seed) { return make_layer_keeping(seed, 1); }

/* L blocks: h = h + moe(h, topk_router(h W_r)); loss = CE(h W_head, y). Each block may sit in
 * a checkpoint segment. */
static kt_graph *build(int layers, int segments)
{
    kt_graph *g;
    kt_value x, y, h, head, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(T, H), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(T), &y));
    h = x;
    for (int l = 0; l < layers; l++) {
        char name[32];
        kt_value wr, r, out[2], in3[3], m, in2[2];
        if (segments)
            OK(kt_graph_checkpoint_begin(g));
        snprintf(name, sizeof name, "route%d.w", l);
        OK(kt_graph_param(g, name, KT_F32, 2, TU_SHAPE(H, E), kt_init_normal(0.3f), &wr));
        in2[0] = h, in2[1] = wr;
        OK(kt_graph_op(g, NULL, KT_OP_MATMUL, NULL, in2, 2, &r));
        kt_op_attrs ra = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = K, .norm_topk = 1);
        OK(kt_graph_op(g, NULL, KT_OP_TOPK_ROUTER, &ra, &r, 1, out));
        in3[0] = h, in3[1] = out[0], in3[2] = out[1];
        kt_op_attrs ma = TU_ATTRS(KT_OP_MOE, .binding = l);
        snprintf(name, sizeof name, "moe%d", l);
        OK(kt_graph_op(g, name, KT_OP_MOE, &ma, in3, 3, &m));
        kt_value s;
        OK(kt_graph_op(g, NULL, KT_OP_SILU, NULL, &m, 1, &s));
        in2[0] = h, in2[1] = s;
        OK(kt_graph_op(g, NULL, KT_OP_ADD, NULL, in2, 2, &h));
        if (segments)
            OK(kt_graph_checkpoint_end(g));
    }
    OK(kt_graph_param(g, "head", KT_F32, 2, TU_SHAPE(H, V), kt_init_normal(0.3f), &head));
    kt_value in2[2] = {h, head};
    OK(kt_graph_op(g, NULL, KT_OP_MATMUL, NULL, in2, 2, &logits));
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100);
    in2[0] = logits, in2[1] = y;
    OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, in2, 2, &loss));
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

typedef struct run_out {
    float loss;
    kt_tensor grads[MAX_LAYERS + 1];
    int n;
    uint64_t moe_flops;
} run_out;

static kt_status run(const kt_program *p, kt_moe **layers, int n_layers, run_out *r,
                     kt_session **keep)
{
    kt_session *s;
    kt_session_options so = {.threads = 2, .seed = 3, .moe_layers = layers,
                             .n_moe_layers = n_layers};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, V);
    uint64_t f0 = 0;
    for (int l = 0; l < n_layers; l++)
        f0 += kt__moe_flops_run(layers[l]);
    kt_status st = kt_session_forward(s);
    if (st == KT_OK)
        st = kt_session_backward(s);
    if (st == KT_OK && r != NULL) {
        r->loss = kt_session_loss(s);
        r->n = kt_program_count(p, KT_ROLE_GRAD);
        for (int i = 0; i < r->n; i++) {
            const char *name;
            OK(kt_program_tensor_info(p, KT_ROLE_GRAD, i, &name, NULL));
            kt_tensor g;
            OK(kt_session_tensor(s, KT_ROLE_GRAD, name, &g));
            r->grads[i] = tu_clone(&g);
        }
        r->moe_flops = 0;
        for (int l = 0; l < n_layers; l++)
            r->moe_flops += kt__moe_flops_run(layers[l]);
        r->moe_flops -= f0;
    }
    if (keep != NULL)
        *keep = s;
    else
        kt_session_destroy(s);
    return st;
}

static void out_free(run_out *r)
{
    for (int i = 0; i < r->n; i++)
        tu_free(&r->grads[i]);
}

static void expect_same(const run_out *a, const run_out *b, const char *what)
{
    if (memcmp(&a->loss, &b->loss, sizeof a->loss) != 0)
        fail_msg("%s: loss %.9g vs %.9g", what, a->loss, b->loss);
    assert_int_equal(a->n, b->n);
    for (int i = 0; i < a->n; i++)
        if (!tu_bitwise_equal(&a->grads[i], &b->grads[i]))
            fail_msg("%s: gradient %d differs", what, i);
}

/* One block through a session equals the kernels and the layer called directly. */
static void test_moe_op_matches_layer(void **state)
{
    (void)state;
    kt_moe *layer = make_layer(1), *direct = make_layer(1);
    kt_graph *g = build(1, 0);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_session *s;
    run_out r;
    OK(run(p, &layer, 1, &r, &s));

    kt_tensor x, wr, head;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "route0.w", &wr));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "head", &head));
    /* forward by hand: logits of the router, the layer, silu, residual, head */
    kt_tensor logits = tu_new(KT_F32, T, E), ids = tu_new(KT_I32, T, K), w = tu_new(KT_F32, T, K);
    kt_tensor in2[2] = {x, wr};
    OK(kt_op_forward(KT_OP_MATMUL, NULL, in2, 2, &logits, 1, NULL));
    kt_op_attrs ra = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = K, .norm_topk = 1);
    kt_tensor rout[2] = {ids, w};
    OK(kt_op_forward(KT_OP_TOPK_ROUTER, &ra, &logits, 1, rout, 2, NULL));
    kt_tensor y = tu_new(KT_F32, T, H), a = tu_new(KT_F32, T, H), h = tu_new(KT_F32, T, H);
    OK(kt_moe_forward(direct, &x, &ids, &w, &y));
    OK(kt_op_forward(KT_OP_SILU, NULL, &y, 1, &a, 1, NULL));
    kt_tensor in_add[2] = {x, a};
    OK(kt_op_forward(KT_OP_ADD, NULL, in_add, 2, &h, 1, NULL));
    kt_tensor out = tu_new(KT_F32, T, V);
    kt_tensor in_h[2] = {h, head};
    OK(kt_op_forward(KT_OP_MATMUL, NULL, in_h, 2, &out, 1, NULL));
    kt_tensor got;
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "logits", &got));
    assert_true(tu_bitwise_equal(&got, &out));

    /* the router weights' gradient flows through the layer's grad_weights */
    kt_tensor gwr;
    OK(kt_session_tensor(s, KT_ROLE_GRAD, "route0.w", &gwr));
    double norm = 0;
    for (int64_t i = 0; i < kt_tensor_numel(&gwr); i++)
        norm += fabs(tu_get(&gwr, i));
    assert_true(norm > 0 && isfinite(norm));

    kt_tensor *all[] = {&logits, &ids, &w, &y, &a, &h, &out};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_free(all[i]);
    out_free(&r);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    kt_moe_destroy(layer);
    kt_moe_destroy(direct);
}

/* Checkpointing a 4-layer MoE stack: with the MoE output kept (the default save-list), no
 * expert FLOPs are recomputed; recomputing it through the forward cache also runs no expert
 * twice; recomputing it without the cache re-runs the experts. Gradients are bitwise equal
 * in every case. */
static void test_checkpoint_with_moe(void **state)
{
    (void)state;
    kt_moe *layers[MAX_LAYERS];
    for (int l = 0; l < MAX_LAYERS; l++)
        layers[l] = make_layer(100 + (uint64_t)l);
    kt_graph *g = build(MAX_LAYERS, 1);
    kt_compile_options none = {.training = 1, .override_checkpoint = 1};
    kt_compile_options keep = {.training = 1, .override_checkpoint = 1,
                               .checkpoint = {.kind = KT_CHECKPOINT_SEGMENTS}};
    kt_compile_options recompute = keep;
    recompute.recompute_must_save = 1;
    kt_program *p0, *p1, *p2;
    OK(kt_compile(g, &none, &p0));
    OK(kt_compile(g, &keep, &p1));
    OK(kt_compile(g, &recompute, &p2));
    run_out r0, r1, r2, r3;
    OK(run(p0, layers, MAX_LAYERS, &r0, NULL));
    OK(run(p1, layers, MAX_LAYERS, &r1, NULL));
    expect_same(&r1, &r0, "MoE output kept");
    assert_true(r1.moe_flops == r0.moe_flops); /* no expert recomputed */

    OK(run(p2, layers, MAX_LAYERS, &r2, NULL));
    expect_same(&r2, &r0, "MoE recomputed");
    assert_true(r2.moe_flops > r0.moe_flops); /* the experts ran again */

    for (int l = 0; l < MAX_LAYERS; l++)
        OK(kt_moe_cache_enable(layers[l], 1));
    OK(run(p2, layers, MAX_LAYERS, &r3, NULL));
    expect_same(&r3, &r0, "MoE recomputed through the cache");
    assert_true(r3.moe_flops == r0.moe_flops); /* the cache answered the recompute */
    for (int l = 0; l < MAX_LAYERS; l++)
        assert_int_equal(kt_moe_cache_get_state(layers[l]), KT_MOE_CACHE_EMPTY);
    print_message("MoE FLOPs per step: %llu without checkpointing, %llu kept, %llu recomputed, "
                  "%llu recomputed through the cache\n",
                  (unsigned long long)r0.moe_flops, (unsigned long long)r1.moe_flops,
                  (unsigned long long)r2.moe_flops, (unsigned long long)r3.moe_flops);
    out_free(&r0), out_free(&r1), out_free(&r2), out_free(&r3);
    kt_program_destroy(p0), kt_program_destroy(p1), kt_program_destroy(p2);
    kt_graph_destroy(g);
    for (int l = 0; l < MAX_LAYERS; l++)
        kt_moe_destroy(layers[l]);
}

/* The layer's intermediates follow the checkpoint pass: a moe op in a recomputed segment
 * (every block but the last) is marked to keep none, whether its output is kept or
 * recomputed; without checkpointing every op keeps them. The mark survives a save and load,
 * the loader refuses it on any other step, and layers created as the program advises give
 * the uncheckpointed program's gradients bit for bit while keeping less per token. */
static void test_checkpoint_chooses_moe_keep(void **state)
{
    (void)state;
    kt_graph *g = build(MAX_LAYERS, 1);
    kt_compile_options none = {.training = 1, .override_checkpoint = 1};
    kt_compile_options segs = {
        .training = 1, .override_checkpoint = 1, .checkpoint = {.kind = KT_CHECKPOINT_SEGMENTS}};
    kt_compile_options recompute = segs;
    recompute.recompute_must_save = 1;
    kt_program *p0, *p1, *p2, *loaded;
    OK(kt_compile(g, &none, &p0));
    OK(kt_compile(g, &segs, &p1));
    OK(kt_compile(g, &recompute, &p2));
    size_t bytes;
    OK(kt_program_serialized_size(p1, &bytes));
    void *file = malloc(bytes);
    assert_non_null(file);
    OK(kt_program_serialize(p1, file, bytes));
    OK(kt_program_load_memory(file, bytes, &loaded));
    free(file);
    const kt_program *progs[] = {p0, p1, p2, loaded};
    for (int l = 0; l < MAX_LAYERS; l++) {
        kt_program_moe info[4];
        for (int i = 0; i < 4; i++)
            OK(kt_program_moe_info(progs[i], l, &info[i]));
        assert_int_equal(info[0].keep_activations, 1);
        for (int i = 1; i < 4; i++)
            if (info[i].keep_activations != (l == MAX_LAYERS - 1))
                fail_msg("program %d, moe%d: keep_activations %d", i, l, info[i].keep_activations);
    }

    /* the mark on a step that is not a moe forward of the forward schedule (a clone, a
     * backward, any other op) is a format error */
    for (int32_t at = 0; at < loaded->n_steps; at++) {
        kt__pstep *s = &loaded->steps[at];
        if (s->kind == KT__STEP_FORWARD && s->op == KT_OP_MOE && at < loaded->n_forward)
            continue; /* where the mark may be */
        const int32_t saved = s->flags;
        s->flags |= KT__STEP_STATE_RECOMPUTES;
        TU_EXPECT_ERROR(kt__program_validate(loaded), KT_EFORMAT, "invalid flags");
        s->flags = saved;
    }
    OK(kt__program_validate(loaded));

    kt_moe *kept[MAX_LAYERS], *advised[MAX_LAYERS];
    for (int l = 0; l < MAX_LAYERS; l++) {
        kt_program_moe info;
        OK(kt_program_moe_info(p1, l, &info));
        kept[l] = make_layer_keeping(200 + (uint64_t)l, 1);
        advised[l] = make_layer_keeping(200 + (uint64_t)l, info.keep_activations);
        if (info.keep_activations)
            continue; /* created alike: nothing to compare */
        kt_moe_memory ma, mb;
        kt_moe_get_memory(kept[l], &ma);
        kt_moe_get_memory(advised[l], &mb);
        uint64_t a = ma.saved_bytes_per_token, b = mb.saved_bytes_per_token;
        if (b + (uint64_t)K * 2 * I * 4 != a)
            fail_msg("moe%d: %llu bytes a token kept, %llu as advised", l, (unsigned long long)a,
                     (unsigned long long)b);
    }
    run_out r0, r1;
    OK(run(p0, kept, MAX_LAYERS, &r0, NULL));
    OK(run(p1, advised, MAX_LAYERS, &r1, NULL));
    expect_same(&r1, &r0, "layers keeping what the checkpointed program advises");
    out_free(&r0), out_free(&r1);
    for (int l = 0; l < MAX_LAYERS; l++)
        kt_moe_destroy(kept[l]), kt_moe_destroy(advised[l]);
    kt_program_destroy(p0), kt_program_destroy(p1), kt_program_destroy(p2);
    kt_program_destroy(loaded);
    kt_graph_destroy(g);
}

/* A failure during a recompute poisons the caches; the next forward reports it naming the
 * layer; the step after is clean and equals a fresh run. */
static void test_failure_injection(void **state)
{
    (void)state;
    kt_moe *layers[MAX_LAYERS];
    for (int l = 0; l < MAX_LAYERS; l++) {
        layers[l] = make_layer(200 + (uint64_t)l);
        OK(kt_moe_cache_enable(layers[l], 1));
    }
    kt_graph *g = build(MAX_LAYERS, 1);
    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = KT_CHECKPOINT_SEGMENTS},
                            .recompute_must_save = 1};
    kt_program *p;
    OK(kt_compile(g, &o, &p));
    int32_t recompute_step = -1;
    for (int32_t i = 0; i < p->n_steps && recompute_step < 0; i++)
        if (p->steps[i].flags & KT__STEP_RECOMPUTE)
            recompute_step = i;
    assert_true(recompute_step > 0);

    run_out clean;
    OK(run(p, layers, MAX_LAYERS, &clean, NULL));

    kt_session *s;
    kt_session_options so = {.threads = 2, .seed = 3, .moe_layers = layers,
                             .n_moe_layers = MAX_LAYERS};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, V);
    OK(kt_session_forward(s));
    OK(kt__session_inject_failure(s, recompute_step));
    TU_EXPECT_ERROR(kt_session_backward(s), KT_EINTERNAL, "injected failure", "recompute");
    int poisoned = 0;
    for (int l = 0; l < MAX_LAYERS; l++)
        poisoned += kt_moe_cache_get_state(layers[l]) == KT_MOE_CACHE_POISONED;
    assert_int_equal(poisoned, MAX_LAYERS);

    /* the next step reports the poisoning, naming the layer and the original failure */
    TU_EXPECT_ERROR(kt_session_forward(s), KT_ESTATE, "moe 'layer'", "poisoned",
                    "injected failure");
    /* and the one after works, with the numbers of a clean run */
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    assert_true(memcmp(&clean.loss, &(float){kt_session_loss(s)}, sizeof(float)) == 0);
    for (int i = 0; i < clean.n; i++) {
        const char *name;
        OK(kt_program_tensor_info(p, KT_ROLE_GRAD, i, &name, NULL));
        kt_tensor gr;
        OK(kt_session_tensor(s, KT_ROLE_GRAD, name, &gr));
        assert_true(tu_bitwise_equal(&gr, &clean.grads[i]));
    }
    out_free(&clean);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    for (int l = 0; l < MAX_LAYERS; l++)
        kt_moe_destroy(layers[l]);
}

/* Sessions check their bindings: a missing layer, a layer of the wrong width, one layer for
 * two nodes. */
static void test_bindings(void **state)
{
    (void)state;
    kt_graph *g = build(2, 0);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_moe *one = make_layer(5);
    kt_session *s = NULL;
    kt_session_options so = {.moe_layers = &one, .n_moe_layers = 1};
    TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EINVAL, "moe1", "MoE layer 1",
                    "1 layer is given");
    kt_moe_config c = *kt_moe_get_config(one);
    c.hidden = H / 2;
    kt_moe *narrow;
    OK(kt_moe_create(&c, NULL, &narrow));
    kt_moe *pair[2] = {one, narrow};
    so.moe_layers = pair;
    so.n_moe_layers = 2;
    TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EINVAL, "moe1", "does not fit",
                    "H=16");
    kt_program_destroy(p);
    kt_graph_destroy(g);
    /* two nodes of one name on one layer: the message tells them apart by their steps */
    OK(kt_graph_create(&g));
    kt_value vx, h, r, out[2], wr;
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(T, H), &vx));
    OK(kt_graph_param(g, "route.w", KT_F32, 2, TU_SHAPE(H, E), kt_init_normal(0.3f), &wr));
    h = vx;
    for (int k = 0; k < 2; k++) {
        OK(kt_graph_op(g, NULL, KT_OP_MATMUL, NULL, (kt_value[]){h, wr}, 2, &r));
        OK(kt_graph_op(g, NULL, KT_OP_TOPK_ROUTER,
                       &TU_ATTRS(KT_OP_TOPK_ROUTER, .k = K, .norm_topk = 1), &r, 1, out));
        OK(kt_graph_op(g, "m", KT_OP_MOE, &TU_ATTRS(KT_OP_MOE, .binding = 0),
                       (kt_value[]){h, out[0], out[1]}, 3, &h));
    }
    OK(kt_graph_output(g, h, "y"));
    OK(kt_compile(g, NULL, &p));
    so.moe_layers = &one;
    so.n_moe_layers = 1;
    TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EINVAL, "moe node 'm' (step ",
                    "runs MoE layer 0, which moe node 'm' (step ");
    kt_program_destroy(p);
    /* a layer index past what a session's table holds is refused where it is written */
    TU_EXPECT_ERROR(kt_graph_op(g, "far", KT_OP_MOE, &TU_ATTRS(KT_OP_MOE, .binding = 1000000000),
                                (kt_value[]){vx, out[0], out[1]}, 3, &h),
                    KT_EINVAL, "layer 1000000000 is outside 0 to 4095");
    kt_graph_destroy(g);
    /* a direct call has no layer to run */
    kt_tensor x = tu_new(KT_F32, T, H), ids = tu_new(KT_I32, T, K), w = tu_new(KT_F32, T, K);
    kt_tensor y = tu_new(KT_F32, T, H);
    kt_tensor in[3] = {x, ids, w};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MOE, NULL, in, 3, &y, 1, NULL), KT_EINVAL,
                    "no MoE layer is bound");
    tu_free(&x), tu_free(&ids), tu_free(&w), tu_free(&y);
    kt_moe_destroy(one);
    kt_moe_destroy(narrow);
}

/* What a trainer reads off a program to create its MoE layers and check its token ids:
 * each moe op's binding and shapes, E from the router that chose the ids (unknown when the
 * ids are an input), and the vocabulary of the integer inputs (embedding rows, classes). */
static void test_program_queries(void **state)
{
    (void)state;
    kt_graph *g = build(2, 1);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    assert_int_equal(kt_program_moe_count(p), 2);
    for (int l = 0; l < 2; l++) {
        kt_program_moe info;
        char name[16];
        OK(kt_program_moe_info(p, l, &info));
        snprintf(name, sizeof name, "moe%d", l);
        assert_string_equal(info.name, name);
        assert_int_equal(info.binding, l);
        assert_int_equal(info.tokens, T);
        assert_int_equal(info.hidden, H);
        assert_int_equal(info.top_k, K);
        assert_int_equal(info.n_experts, E);
        assert_int_equal(info.act_dtype, KT_F32);
    }
    kt_program_moe info;
    TU_EXPECT_ERROR(kt_program_moe_info(p, 2, &info), KT_EINVAL, "index 2", "2 moe ops");
    int64_t bound;
    OK(kt_program_index_bound(p, "y", &bound));
    assert_int_equal(bound, V); /* cross_entropy's classes */
    OK(kt_program_index_bound(p, "x", &bound));
    assert_int_equal(bound, -1);
    TU_EXPECT_ERROR(kt_program_index_bound(p, "z", &bound), KT_EINVAL, "no input named 'z'");
    kt_program_destroy(p);
    kt_graph_destroy(g);

    /* tokens -> embedding [7, H] -> moe with the routing as inputs -> head [H, 9] -> loss */
    kt_value tok, ids, w, y, table, head, h, m, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "tokens", KT_I32, 1, TU_SHAPE(T), &tok));
    OK(kt_graph_input(g, "ids", KT_I32, 2, TU_SHAPE(T, K), &ids));
    OK(kt_graph_input(g, "w", KT_F32, 2, TU_SHAPE(T, K), &w));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(T), &y));
    OK(kt_graph_param(g, "table", KT_F32, 2, TU_SHAPE(7, H), kt_init_normal(0.3f), &table));
    OK(kt_graph_param(g, "head", KT_F32, 2, TU_SHAPE(H, 9), kt_init_normal(0.3f), &head));
    h = tu_op2(g, "embed", KT_OP_EMBEDDING, NULL, table, tok);
    OK(kt_graph_op(g, "moe", KT_OP_MOE, &TU_ATTRS(KT_OP_MOE, .binding = 3), (kt_value[]){h, ids, w},
                   3, &m));
    logits = tu_op2(g, "logits", KT_OP_MATMUL, NULL, m, head);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, NULL, logits, y);
    OK(kt_graph_set_loss(g, loss));
    OK(kt_compile(g, NULL, &p));
    OK(kt_program_moe_info(p, 0, &info));
    assert_int_equal(info.binding, 3);
    assert_int_equal(info.n_experts, 0);
    OK(kt_program_index_bound(p, "tokens", &bound));
    assert_int_equal(bound, 7);
    OK(kt_program_index_bound(p, "y", &bound));
    assert_int_equal(bound, 9);
    OK(kt_program_index_bound(p, "ids", &bound));
    assert_int_equal(bound, -1);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* A LoRA layer trains through the session's optimizer: after one SGD step every adapter
 * value moved by exactly -lr * its gradient; bf16 experts in full mode are refused. */
static void test_moe_lora_trains(void **state)
{
    (void)state;
    kt_moe_config c = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                       .max_tokens = T, .weight_dtype = KT_BF16, .act_dtype = KT_F32,
                       .mode = KT_MOE_LORA, .lora_rank = 4, .lora_alpha = 8.0f,
                       .keep_activations = 1, .name = "lora"};
    kt_moe *m;
    OK(kt_moe_create(&c, NULL, &m));
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w;
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &w));
            tu_fill_uniform(&w, &rng, -0.3, 0.3);
            /* B starts at zero (as PEFT): give it values so A gets a gradient too */
            kt_tensor b;
            OK(kt_moe_lora(m, e, (kt_moe_proj)p, 1, &b));
            tu_fill_uniform(&b, &rng, -0.1, 0.1);
        }
    kt_graph *g = build(1, 0);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    const float lr = 0.05f;
    kt_session_options so = {.threads = 2, .seed = 3, .moe_layers = &m, .n_moe_layers = 1,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = lr}};
    kt_session *s;
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, V);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    kt_tensor a, ga, b, gb;
    OK(kt_moe_lora(m, 2, KT_MOE_UP, 0, &a));
    OK(kt_moe_lora_grad(m, 2, KT_MOE_UP, 0, &ga));
    OK(kt_moe_lora(m, 2, KT_MOE_DOWN, 1, &b));
    OK(kt_moe_lora_grad(m, 2, KT_MOE_DOWN, 1, &gb));
    kt_tensor a0 = tu_clone(&a), ga0 = tu_clone(&ga), b0 = tu_clone(&b), gb0 = tu_clone(&gb);
    double moved = 0;
    for (int64_t i = 0; i < kt_tensor_numel(&ga0); i++)
        moved += fabs(tu_get(&ga0, i));
    assert_true(moved > 0); /* the adapters of a used expert have gradients */
    OK(kt_session_step(s));
    for (int64_t i = 0; i < kt_tensor_numel(&a); i++)
        assert_float_equal(tu_get(&a, i), tu_get(&a0, i) - lr * tu_get(&ga0, i), 1e-7);
    for (int64_t i = 0; i < kt_tensor_numel(&b); i++)
        assert_float_equal(tu_get(&b, i), tu_get(&b0, i) - lr * tu_get(&gb0, i), 1e-7);
    /* a few more steps lower the loss */
    float first = kt_session_loss(s), last = first;
    for (int k = 0; k < 8; k++) {
        OK(kt_session_forward(s));
        last = kt_session_loss(s);
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    assert_true(last < first);
    tu_free(&a0), tu_free(&ga0), tu_free(&b0), tu_free(&gb0);
    kt_session_destroy(s);

    /* bf16 experts trained in full mode have no f32 master copy to update */
    kt_moe_config f = c;
    f.mode = KT_MOE_FULL;
    kt_moe *full;
    OK(kt_moe_create(&f, NULL, &full));
    so.moe_layers = &full;
    TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EUNSUPPORTED, "bf16 expert weights",
                    "LoRA");
    kt_moe_destroy(full);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    kt_moe_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_op_matches_layer),
        cmocka_unit_test(test_checkpoint_with_moe),
        cmocka_unit_test(test_checkpoint_chooses_moe_keep),
        cmocka_unit_test(test_failure_injection),
        cmocka_unit_test(test_bindings),
        cmocka_unit_test(test_moe_lora_trains),
        cmocka_unit_test(test_program_queries),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
