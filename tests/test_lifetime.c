/* Object lifetimes a new user trips on: every create function leaves NULL in its output when
 * it fails (SQLite's rule: a garbage handle must never reach a destroy), and a session keeps
 * its program and its MoE layers alive, so destroying them first is safe (ASan checks the
 * "safe"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kt/kt.h"
#include "tests/support/test_util.h"

#define GARBAGE ((void *)(uintptr_t)0xdeadbeef)

/* call fails, and leaves NULL where `out` pointed at garbage */
#define EXPECT_NULL_ON_FAILURE(out, call)                                                     \
    do {                                                                                      \
        out = GARBAGE;                                                                        \
        assert_int_not_equal((call), KT_OK);                                                  \
        if ((void *)(out) != NULL)                                                            \
            fail_msg("%s failed and left its output set", #call);                             \
    } while (0)

static void failed_creates_leave_null(void **ctx)
{
    (void)ctx;
    kt_session *s;
    kt_program *p;
    kt_graph *g;
    kt_moe *m;
    kt_threadpool *pool;
    kt_comm *comm;
    kt_st_file *f;
    kt_out_file *o;
    kt_moe_scratch *sc;
    EXPECT_NULL_ON_FAILURE(s, kt_session_create(NULL, NULL, &s));
    EXPECT_NULL_ON_FAILURE(p, kt_program_load("/nonexistent/x.ktp", &p));
    EXPECT_NULL_ON_FAILURE(p, kt_program_load_memory("KTPROGRM garbage", 16, &p));
    EXPECT_NULL_ON_FAILURE(p, kt_compile(NULL, NULL, &p));
    OK(kt_graph_create(&g)); /* an empty graph: training wants a loss */
    EXPECT_NULL_ON_FAILURE(p, kt_compile(g, &(kt_compile_options){.training = 1}, &p));
    kt_graph_destroy(g);
    char diag[256];
    int n_errors = 0;
    const char bad[] = "this is not a model\n";
    EXPECT_NULL_ON_FAILURE(g, kt_ktg_parse(bad, sizeof bad - 1, "bad.ktg", NULL, 0, &g, diag,
                                           sizeof diag, &n_errors));
    kt_moe_config bad_cfg = {.n_experts = 0, .hidden = 8, .intermediate = 8, .top_k = 1};
    EXPECT_NULL_ON_FAILURE(m, kt_moe_create(&bad_cfg, NULL, &m));
    EXPECT_NULL_ON_FAILURE(m, kt_moe_create(NULL, NULL, &m));
    EXPECT_NULL_ON_FAILURE(pool, kt_threadpool_create(1 << 30, &pool));
    EXPECT_NULL_ON_FAILURE(pool, kt_threadpool_create_numa(1 << 30, &pool));
    kt_comm_options co = {.rank = 3, .world_size = 2}; /* a rank outside the world */
    EXPECT_NULL_ON_FAILURE(comm, kt_comm_create_ucx(&co, &comm));
    EXPECT_NULL_ON_FAILURE(f, kt_st_open("/nonexistent/x.safetensors", &f));
    EXPECT_NULL_ON_FAILURE(f, kt_st_open_memory("garbage!", 8, NULL, &f));
    EXPECT_NULL_ON_FAILURE(o, kt_out_open("", &o));
    EXPECT_NULL_ON_FAILURE(sc, kt_moe_scratch_create(-7, &sc));
}

enum { T = 8, H = 16, I = 8, E = 4, K = 2, V = 5 };

/* h = moe(x, topk_router(x W_r)); loss = CE(h W_head, y) */
static kt_program *moe_program(void)
{
    kt_graph *g;
    kt_program *p;
    kt_value x, y, wr, r, route[2], in3[3], h, head, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(T, H), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(T), &y));
    OK(kt_graph_param(g, "route.w", KT_F32, 2, TU_SHAPE(H, E), kt_init_normal(0.3f), &wr));
    OK(kt_graph_op(g, NULL, KT_OP_MATMUL, NULL, (kt_value[]){x, wr}, 2, &r));
    OK(kt_graph_op(g, NULL, KT_OP_TOPK_ROUTER,
                   &TU_ATTRS(KT_OP_TOPK_ROUTER, .k = K, .norm_topk = 1), &r, 1, route));
    in3[0] = x, in3[1] = route[0], in3[2] = route[1];
    OK(kt_graph_op(g, "moe", KT_OP_MOE, &TU_ATTRS(KT_OP_MOE, .binding = 0), in3, 3, &h));
    OK(kt_graph_param(g, "head", KT_F32, 2, TU_SHAPE(H, V), kt_init_normal(0.3f), &head));
    OK(kt_graph_op(g, NULL, KT_OP_MATMUL, NULL, (kt_value[]){h, head}, 2, &logits));
    OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, NULL, (kt_value[]){logits, y}, 2, &loss));
    OK(kt_graph_set_loss(g, loss));
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* The program, the layer and the caller's layer array all go before the session; the
 * session still trains (forward, backward, step) and frees them when it goes. */
static void session_outlives_what_it_uses(void **ctx)
{
    (void)ctx;
    kt_program *p = moe_program();
    kt_moe_config c = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                       .max_tokens = T, .weight_dtype = KT_F32, .act_dtype = KT_F32,
                       .mode = KT_MOE_LORA, .lora_rank = 2, .lora_alpha = 4, .name = "l0"};
    kt_moe *layers[1] = {NULL};
    OK(kt_moe_create(&c, NULL, &layers[0]));
    kt_session *s;
    kt_session_options o = {.threads = 1, .moe_layers = layers, .n_moe_layers = 1,
                            .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    OK(kt_session_create(p, &o, &s));
    kt_program_destroy(p);
    kt_moe_destroy(layers[0]);
    layers[0] = NULL; /* the caller's array may change or go: the session copied it */
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, V);
    for (int k = 0; k < 2; k++) {
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    kt_session_destroy(s);
}

/* A session without a learning rate refuses to step instead of training nothing. */
static void step_without_learning_rate(void **ctx)
{
    (void)ctx;
    kt_program *p = moe_program();
    kt_moe_config c = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                       .max_tokens = T, .weight_dtype = KT_F32, .act_dtype = KT_F32,
                       .mode = KT_MOE_FROZEN, .name = "l0"};
    kt_moe *layer;
    OK(kt_moe_create(&c, NULL, &layer));
    kt_session *s;
    kt_session_options o = {.threads = 1, .moe_layers = &layer, .n_moe_layers = 1};
    OK(kt_session_create(p, &o, &s));
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    TU_EXPECT_ERROR(kt_session_step(s), KT_EINVAL, "learning rate is 0");
    assert_int_equal(kt_session_step_count(s), 0);
    kt_session_destroy(s);
    kt_moe_destroy(layer);
    kt_program_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(failed_creates_leave_null),
        cmocka_unit_test(session_outlives_what_it_uses),
        cmocka_unit_test(step_without_learning_rate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
