/* The new ops through .ktg as a decoder layer would use them, compiled and trained on:
 * Qwen2-MoE's gated shared expert (sigmoid of a [T,1] gate scaling each row), OLMoE's
 * clip_qkv (clamp), DeepSeek MLA's shared rope key head (expand over the heads, concat with
 * the per-head part on 4-d tensors), batched attention-style products (matmul over [B,H,T,D]),
 * sum and mean over negative dims, a per-row add. Every parameter's gradient from the session
 * is checked against central differences of the session's own loss. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kt/kt.h"
#include "tests/support/test_util.h"

static const char model[] =
    "const T = 6\n"
    "const H = 8\n"
    "const NH = 2\n"
    "const DN = 3\n"
    "const DR = 2\n"
    "const V = 5\n"
    "input x: f32[T, H]\n"
    "input y: i32[T]\n"
    "param gate: f32[1, H] = normal(0.5)\n"
    "param up: f32[H, H] = normal(0.3)\n"
    "param wq: f32[H, NH * (DN + DR)] = normal(0.4)\n"
    "param wkv: f32[H, NH * DN + DR] = normal(0.4)\n"
    "param head: f32[H, V] = normal(0.3)\n"
    "# the gated shared expert: sigmoid(x gate^T) [T,1] scales each row\n"
    "g = matmul(x, gate, trans_b = 1)\n"
    "s = sigmoid(g)\n"
    "e = matmul(x, up)\n"
    "e = mul(e, s)\n"
    "# MLA-style heads: q [1,T,NH,DN+DR]; k = [k_nope | k_pe shared by every head]\n"
    "q = matmul(x, wq)\n"
    "q = clamp(q, min = -1.5, max = 1.5)\n"
    "q = reshape(q, shape = [1, T, NH, DN + DR])\n"
    "kv = matmul(x, wkv)\n"
    "kn = narrow(kv, dim = -1, start = 0, length = NH * DN)\n"
    "kn = reshape(kn, shape = [1, T, NH, DN])\n"
    "kp = narrow(kv, dim = 1, start = NH * DN, length = DR)\n"
    "kp = reshape(kp, shape = [1, T, 1, DR])\n"
    "kp = expand(kp, dim = -2, size = NH)\n"
    "k = concat(kn, kp, dim = -1)\n"
    "# scores per head [1,NH,T,T], each row's mean, summed over the heads\n"
    "qh = transpose(q, dim0 = 1, dim1 = 2)\n"
    "kh = transpose(k, dim0 = 1, dim1 = 2)\n"
    "sc = matmul(qh, kh, trans_b = 1)\n"
    "m = mean(sc, dim = -1, keepdim = 1)\n"
    "m = sum(m, dim = 1)\n"
    "m = reshape(m, shape = [T, 1])\n"
    "h = add(e, m)\n"
    "h = sub(h, s)\n"
    "logits = matmul(h, head)\n"
    "loss = cross_entropy(logits, y)\n"
    "output logits\n"
    "loss loss\n";

static const char *const params[] = {"gate", "up", "wq", "wkv", "head"};

static float loss_of(kt_session *s)
{
    OK(kt_session_forward(s));
    return kt_session_loss(s);
}

static void test_block_trains(void **state)
{
    (void)state;
    kt_graph *g = NULL;
    char diag[4096];
    int n_err = 0;
    if (kt_ktg_parse(model, strlen(model), "blocks.ktg", NULL, 0, &g, diag, sizeof diag,
                     &n_err) != KT_OK)
        fail_msg("blocks.ktg does not parse:\n%s", diag);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_session *s;
    kt_session_options so = {.threads = 2, .seed = 7};
    OK(kt_session_create(p, &so, &s));
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    kt_tensor t;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &t));
    tu_fill_uniform(&t, &rng, -1, 1);
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &t));
    tu_fill_uniform(&t, &rng, 0, 5);
    (void)loss_of(s);
    OK(kt_session_backward(s));
    int clamped = 0;
    for (size_t i = 0; i < sizeof params / sizeof params[0]; i++) {
        kt_tensor w, gw;
        OK(kt_session_tensor(s, KT_ROLE_PARAM, params[i], &w));
        OK(kt_session_tensor(s, KT_ROLE_GRAD, params[i], &gw));
        kt_tensor grad = tu_clone(&gw); /* forward runs below leave it alone, but be sure */
        double scale = 1e-3, err = 0.0;
        for (int64_t k = 0; k < kt_tensor_numel(&w); k++) {
            const float x0 = ((float *)w.data)[k], h = 1e-2f;
            ((float *)w.data)[k] = x0 + h;
            const double lp = loss_of(s);
            ((float *)w.data)[k] = x0 - h;
            const double lm = loss_of(s);
            ((float *)w.data)[k] = x0;
            const double fd = (lp - lm) / (2.0 * (double)h);
            scale = fmax(scale, fabs(fd));
            err = fmax(err, fabs(fd - tu_get(&grad, k)));
        }
        if (err / scale > 2e-2)
            fail_msg("%s: gradient off by %.3g of its scale %.3g", params[i], err / scale, scale);
        tu_free(&grad);
    }
    /* the clamp bounds something: otherwise the test would not cover its mask */
    kt_tensor x, wq;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "wq", &wq));
    for (int64_t r = 0; r < 6; r++)
        for (int64_t c = 0; c < 10; c++) {
            double q = 0.0;
            for (int64_t k = 0; k < 8; k++)
                q += tu_get(&x, r * 8 + k) * tu_get(&wq, k * 10 + c);
            clamped += fabs(q) > 1.5;
        }
    assert_true(clamped > 0);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_block_trains)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
