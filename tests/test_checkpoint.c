/* Activation checkpointing: gradients bitwise equal with and without, for every policy;
 * activation peaks; the budget policy; the save-list (router outputs are never recomputed). */
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
#include "tests/support/test_util.h"

/* A conv stack with one checkpoint block per layer and a router in every layer (its weights
 * gate a residual branch), so the save-list is exercised too. */
static const char *model_text =
    "const B = 2\n"
    "const T = 24\n"
    "const C = 16\n"
    "const E = 4\n"
    "const L = 9\n"
    "input x: f32[B, T, C]\n"
    "input y: i32[B * T]\n"
    "h = silu(x)\n"
    "repeat l in 0..L {\n"
    "  checkpoint {\n"
    "    param conv{l}.w: f32[C, 3, C] = normal(0.1)\n"
    "    param dw{l}.w: f32[C, 5] = normal(0.2)\n"
    "    param norm{l}.w: f32[C] = ones\n"
    "    param route{l}.w: f32[C, E] = normal(0.3)\n"
    "    param gate{l}.w: f32[2, C] = normal(0.3)\n"
    "    a = conv1d(h, conv{l}.w, mode = causal)\n"
    "    a = silu(a)\n"
    "    a = conv1d(a, dw{l}.w, mode = same, depthwise = 1)\n"
    "    f = reshape(a, shape = [B * T, C])\n"
    "    r = matmul(f, route{l}.w)\n"
    "    ids, w = topk_router(r, k = 2)\n"
    "    g = matmul(w, gate{l}.w)\n"
    "    g = reshape(g, shape = [B, T, C])\n"
    "    a = mul(a, g)\n"
    "    h = add(h, a)\n"
    "    h = rmsnorm(h, norm{l}.w, eps = 1e-5)\n"
    "  }\n"
    "}\n"
    "param head.w: f32[C, 5] = normal(0.2)\n"
    "flat = reshape(h, shape = [B * T, C])\n"
    "logits = matmul(flat, head.w)\n"
    "loss = cross_entropy(logits, y)\n"
    "output logits\n"
    "loss loss\n";

static kt_graph *parse(int64_t layers)
{
    kt_graph *g = NULL;
    char diag[4096];
    kt_ktg_define d = {"L", layers};
    if (kt_ktg_parse(model_text, strlen(model_text), "ckpt.ktg", &d, 1, &g, diag, sizeof diag,
                     NULL) != KT_OK)
        fail_msg("parse: %s", diag);
    return g;
}

static kt_program *compile(kt_graph *g, kt_checkpoint_policy_kind kind, int64_t k,
                           uint64_t budget)
{
    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = kind, .k = k, .budget_bytes = budget}};
    kt_program *p;
    OK(kt_compile(g, &o, &p));
    return p;
}

typedef struct run_result {
    float loss;
    int n_grads;
    kt_tensor grads[64];
} run_result;

static void run(const kt_program *p, run_result *r)
{
    kt_session *s;
    kt_session_options so = {.threads = 2, .seed = 11};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, 5);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    r->loss = kt_session_loss(s);
    r->n_grads = kt_program_count(p, KT_ROLE_GRAD);
    assert_true(r->n_grads <= 64);
    for (int i = 0; i < r->n_grads; i++) {
        const char *name;
        OK(kt_program_tensor_info(p, KT_ROLE_GRAD, i, &name, NULL));
        kt_tensor g;
        OK(kt_session_tensor(s, KT_ROLE_GRAD, name, &g));
        r->grads[i] = tu_clone(&g);
    }
    kt_session_destroy(s);
}

static void result_free(run_result *r)
{
    for (int i = 0; i < r->n_grads; i++)
        tu_free(&r->grads[i]);
}

static void expect_same(const run_result *a, const run_result *b, const char *policy)
{
    if (memcmp(&a->loss, &b->loss, sizeof a->loss) != 0)
        fail_msg("%s: loss %.9g differs from %.9g without checkpointing", policy, a->loss,
                 b->loss);
    assert_int_equal(a->n_grads, b->n_grads);
    for (int i = 0; i < a->n_grads; i++)
        if (!tu_bitwise_equal(&a->grads[i], &b->grads[i]))
            fail_msg("%s: gradient %d differs from the uncheckpointed one", policy, i);
}

static void stats(const kt_program *p, kt_program_stats *st) { kt_program_get_stats(p, st); }

/* Checkpointing changes memory, never numbers. */
static void test_gradients_bitwise_equal(void **state)
{
    (void)state;
    kt_graph *g = parse(9);
    kt_program *plain = compile(g, KT_CHECKPOINT_NONE, 0, 0);
    run_result base;
    run(plain, &base);
    kt_program_stats sp;
    stats(plain, &sp);
    assert_int_equal(sp.n_recompute_steps, 0);

    const struct {
        const char *name;
        kt_checkpoint_policy_kind kind;
        int64_t k;
        uint64_t budget;
    } policies[] = {{"segments", KT_CHECKPOINT_SEGMENTS, 0, 0},
                    {"every_k(2)", KT_CHECKPOINT_EVERY_K, 2, 0},
                    {"every_k(4)", KT_CHECKPOINT_EVERY_K, 4, 0},
                    {"sqrtn", KT_CHECKPOINT_SQRTN, 0, 0},
                    {"budget", KT_CHECKPOINT_BUDGET, 0, sp.arena_bytes * 6 / 10}};
    for (size_t i = 0; i < sizeof policies / sizeof policies[0]; i++) {
        kt_program *p = compile(g, policies[i].kind, policies[i].k, policies[i].budget);
        kt_program_stats st;
        stats(p, &st);
        print_message("%-11s planned peak %7llu bytes (%.3fx of %llu), %3d recompute steps, "
                      "recompute FLOPs %.3fx the forward\n",
                      policies[i].name, (unsigned long long)st.arena_bytes,
                      (double)st.arena_bytes / (double)sp.arena_bytes,
                      (unsigned long long)sp.arena_bytes, st.n_recompute_steps,
                      st.recompute_flops / st.forward_flops);
        assert_true(st.n_recompute_steps > 0);
        assert_true(st.arena_bytes < sp.arena_bytes);
        if (policies[i].kind == KT_CHECKPOINT_BUDGET)
            assert_true(st.arena_bytes <= policies[i].budget);
        run_result r;
        run(p, &r);
        expect_same(&r, &base, policies[i].name);
        result_free(&r);
        kt_program_destroy(p);
    }
    result_free(&base);
    kt_program_destroy(plain);
    kt_graph_destroy(g);
}

/* The router is on the save-list: no recompute step runs it; with recompute_must_save it is
 * recomputed like the rest, and the numbers still do not change. */
static void test_save_list(void **state)
{
    (void)state;
    kt_graph *g = parse(4);
    kt_program *p = compile(g, KT_CHECKPOINT_SEGMENTS, 0, 0);
    int routers = 0;
    for (int32_t i = 0; i < p->n_steps; i++)
        if ((p->steps[i].flags & KT__STEP_RECOMPUTE) && p->steps[i].op == KT_OP_TOPK_ROUTER)
            routers++;
    assert_int_equal(routers, 0);

    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = KT_CHECKPOINT_SEGMENTS},
                            .recompute_must_save = 1};
    kt_program *q;
    OK(kt_compile(g, &o, &q));
    for (int32_t i = 0; i < q->n_steps; i++)
        if ((q->steps[i].flags & KT__STEP_RECOMPUTE) && q->steps[i].op == KT_OP_TOPK_ROUTER)
            routers++;
    assert_int_equal(routers, 3); /* every segment but the last */
    run_result a, b;
    run(p, &a);
    run(q, &b);
    expect_same(&a, &b, "router recomputed");
    result_free(&a);
    result_free(&b);
    kt_program_destroy(p);
    kt_program_destroy(q);
    kt_graph_destroy(g);
}

/* A budget below what any segmentation reaches is an error naming the smallest peak; a
 * budget policy never exceeds its budget; recompute steps survive a .ktp round trip. */
static void test_budget_and_files(void **state)
{
    (void)state;
    kt_graph *g = parse(9);
    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = KT_CHECKPOINT_BUDGET, .budget_bytes = 1000}};
    kt_program *p = NULL;
    TU_EXPECT_ERROR(kt_compile(g, &o, &p), KT_EINVAL, "budget of 1000 bytes",
                    "smallest planned peak reachable");
    kt_program *plain = compile(g, KT_CHECKPOINT_NONE, 0, 0);
    kt_program_stats sp;
    stats(plain, &sp);
    for (uint64_t frac = 5; frac <= 10; frac++) {
        uint64_t budget = sp.arena_bytes * frac / 10;
        kt_compile_options b = {.training = 1, .override_checkpoint = 1,
                                .checkpoint = {.kind = KT_CHECKPOINT_BUDGET,
                                               .budget_bytes = budget}};
        if (kt_compile(g, &b, &p) != KT_OK)
            continue; /* below the smallest peak: covered above */
        kt_program_stats st;
        stats(p, &st);
        assert_true(st.arena_bytes <= budget);
        kt_program_destroy(p);
    }
    p = compile(g, KT_CHECKPOINT_SQRTN, 0, 0);
    size_t n;
    OK(kt_program_serialized_size(p, &n));
    void *buf = malloc(n);
    OK(kt_program_serialize(p, buf, n));
    kt_program *q;
    OK(kt_program_load_memory(buf, n, &q));
    kt_program_stats a, b;
    stats(p, &a);
    stats(q, &b);
    assert_int_equal(a.n_recompute_steps, b.n_recompute_steps);
    assert_true(a.recompute_flops == b.recompute_flops);
    run_result ra, rb;
    run(p, &ra);
    run(q, &rb);
    expect_same(&ra, &rb, "loaded program");
    result_free(&ra);
    result_free(&rb);
    free(buf);
    kt_program_destroy(p);
    kt_program_destroy(q);
    kt_program_destroy(plain);
    kt_graph_destroy(g);
}

/* 16 layers with sqrt(n) segments: the activation peak drops to at most 0.40x. */
static void test_sqrtn_peak_16_layers(void **state)
{
    (void)state;
    kt_graph *g = parse(16);
    kt_program *plain = compile(g, KT_CHECKPOINT_NONE, 0, 0);
    kt_program *p = compile(g, KT_CHECKPOINT_SQRTN, 0, 0);
    kt_program_stats sp, st;
    stats(plain, &sp);
    stats(p, &st);
    double ratio = (double)st.arena_bytes / (double)sp.arena_bytes;
    print_message("16 layers, sqrt(n): peak %llu of %llu bytes = %.3fx; recompute %.3fx of the "
                  "forward FLOPs\n",
                  (unsigned long long)st.arena_bytes, (unsigned long long)sp.arena_bytes, ratio,
                  st.recompute_flops / st.forward_flops);
    assert_true(ratio <= 0.40);
    kt_program_destroy(p);
    kt_program_destroy(plain);
    kt_graph_destroy(g);
}

/* Policies without blocks: nodes are the units. A segments policy without blocks fails. */
static void test_policies_without_blocks(void **state)
{
    (void)state;
    const char *text = "input x: f32[8, 16]\ninput y: i32[8]\nh = silu(x)\n"
                       "repeat i in 0..10 {\n param w{i}: f32[16, 16] = normal(0.2)\n"
                       " h = matmul(h, w{i})\n h = silu(h)\n}\n"
                       "loss = cross_entropy(h, y)\nloss loss\n";
    kt_graph *g;
    char diag[1024];
    OK(kt_ktg_parse(text, strlen(text), "chain.ktg", NULL, 0, &g, diag, sizeof diag, NULL));
    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = KT_CHECKPOINT_SEGMENTS}};
    kt_program *p = NULL;
    TU_EXPECT_ERROR(kt_compile(g, &o, &p), KT_EINVAL, "no checkpoint blocks");
    kt_program *plain = compile(g, KT_CHECKPOINT_NONE, 0, 0);
    p = compile(g, KT_CHECKPOINT_SQRTN, 0, 0);
    kt_program_stats st;
    stats(p, &st);
    assert_true(st.n_recompute_steps > 0);
    run_result a, b;
    run(plain, &a);
    run(p, &b);
    expect_same(&b, &a, "sqrtn over nodes");
    result_free(&a);
    result_free(&b);
    kt_program_destroy(p);
    kt_program_destroy(plain);
    kt_graph_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradients_bitwise_equal),
        cmocka_unit_test(test_save_list),
        cmocka_unit_test(test_budget_and_files),
        cmocka_unit_test(test_sqrtn_peak_16_layers),
        cmocka_unit_test(test_policies_without_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
