/* The MoE layer's public API as a new user meets it: what a refused tensor's message says,
 * the handle a failed create leaves, and the layer configuration a program's moe op asks for
 * (kt_program_moe_config). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/test_util.h"


/* H 64, I 128: the gate weight is [128, 64] */
static kt_moe_config small_cfg(void)
{
    return (kt_moe_config){.n_experts = 4,
                           .hidden = 64,
                           .intermediate = 128,
                           .top_k = 2,
                           .max_tokens = 8,
                           .weight_dtype = KT_F32,
                           .act_dtype = KT_F32,
                           .mode = KT_MOE_FROZEN,
                           .keep_activations = 1,
                           .name = "api",
                           .numa_node = -1};
}

/* The case: a transposed view has the right dtype and shape, so only the strides say
 * why it is refused. */
static void test_set_weight_says_what_differs(void **state)
{
    (void)state;
    kt_moe_config c = small_cfg();
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, NULL, &m));
    kt_tensor buf = tu_new(KT_F32, 64, 128), view = buf;
    view.shape[0] = 128, view.shape[1] = 64;
    view.strides[0] = 1, view.strides[1] = 128;
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 0, KT_MOE_GATE, &view), KT_EINVAL, "api", "gate_proj",
                    "expected a contiguous CPU f32[128,64], got f32[128,64]",
                    "its strides are [1,128], not the contiguous [64,1]");
    kt_tensor wrong = tu_new(KT_BF16, 64, 128);
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 0, KT_MOE_GATE, &wrong), KT_EINVAL,
                    "its dtype is bf16, not f32", "its shape is [64,128], not [128,64]");
    kt_tensor gpu = tu_new(KT_F32, 128, 64);
    gpu.device = (kt_device){KT_DEVICE_CUDA, 1};
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 1, KT_MOE_UP, &gpu), KT_EINVAL, "up_proj",
                    "it is on cuda:1, not the CPU");
    gpu.device = (kt_device){KT_DEVICE_CPU, 0};
    OK(kt_moe_set_weight(m, 1, KT_MOE_UP, &gpu)); /* the same tensor on the CPU fits */
    kt_tensor nodata = gpu;
    nodata.data = NULL;
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 1, KT_MOE_UP, &nodata), KT_EINVAL, "no data");
    tu_free(&buf), tu_free(&wrong), tu_free(&gpu);
    kt_moe_destroy(m);
}

static void test_call_tensors_say_what_differs(void **state)
{
    (void)state;
    kt_moe_config c = small_cfg();
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, NULL, &m));
    kt_tensor x = tu_new(KT_F32, 3, 64), ids = tu_new(KT_I32, 3, 2), w = tu_new(KT_F32, 3, 2);
    kt_tensor y = tu_new(KT_F32, 3, 64);
    int32_t *id = ids.data;
    for (int t = 0; t < 3; t++)
        id[2 * t] = 0, id[2 * t + 1] = 1;
    kt_tensor xt = tu_new(KT_F32, 64, 3), xv = xt;
    xv.shape[0] = 3, xv.shape[1] = 64, xv.strides[0] = 1, xv.strides[1] = 3;
    TU_EXPECT_ERROR(kt_moe_forward(m, &xv, &ids, &w, &y), KT_EINVAL, "x must be",
                    "its strides are [1,3], not the contiguous [64,1]");
    kt_tensor ids16 = tu_new(KT_F16, 3, 2);
    TU_EXPECT_ERROR(kt_moe_forward(m, &x, &ids16, &w, &y), KT_EINVAL,
                    "ids must be a contiguous CPU i32 or i64 [3,2]",
                    "its dtype is f16, not i32 or i64");
    kt_tensor y2 = tu_new(KT_F32, 3, 63);
    TU_EXPECT_ERROR(kt_moe_forward(m, &x, &ids, &w, &y2), KT_EINVAL,
                    "its shape is [3,63], not [3,64]");
    OK(kt_moe_forward(m, &x, &ids, &w, &y));
    kt_tensor gy = tu_new(KT_BF16, 3, 64);
    TU_EXPECT_ERROR(kt_moe_backward(m, &gy, NULL, NULL, 1.0f), KT_EINVAL, "grad_y",
                    "its dtype is bf16, not f32");
    tu_free(&x), tu_free(&ids), tu_free(&w), tu_free(&y), tu_free(&xt), tu_free(&ids16);
    tu_free(&y2), tu_free(&gy);
    kt_moe_destroy(m);
}

/* SQLite's rule: a failed create sets the handle to NULL, so destroying it is harmless. */
static void test_failed_create_nulls_handle(void **state)
{
    (void)state;
    kt_moe_config c = small_cfg();
    c.top_k = 9;
    kt_moe *m = (kt_moe *)&c; /* stands for an uninitialised handle */
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "top_k");
    assert_null(m);
    kt_moe_destroy(m);
    m = (kt_moe *)&c;
    TU_EXPECT_ERROR(kt_moe_create(NULL, NULL, &m), KT_EINVAL, "NULL");
    assert_null(m);
    kt_moe_scratch *s = (kt_moe_scratch *)&c;
    TU_EXPECT_ERROR(kt_moe_scratch_create(-7, &s), KT_EINVAL, "numa_node -7");
    assert_null(s);
}

static void test_program_moe_config(void **state)
{
    (void)state;
    const kt_program_moe info = {.name = "blk.moe",
                                 .binding = 3,
                                 .tokens = 16,
                                 .hidden = 64,
                                 .top_k = 2,
                                 .n_experts = 4,
                                 .act_dtype = KT_BF16,
                                 .keep_activations = 0};
    kt_moe_config c;
    OK(kt_program_moe_config(&info, 96, KT_BF16, KT_MOE_LORA, 8, 16.0f, 3, &c));
    assert_int_equal(c.n_experts, 4);
    assert_int_equal(c.hidden, 64);
    assert_int_equal(c.intermediate, 96);
    assert_int_equal(c.top_k, 2);
    assert_int_equal(c.max_tokens, 48); /* rank 0 runs all three ranks' rows */
    assert_int_equal(c.weight_dtype, KT_BF16);
    assert_int_equal(c.act_dtype, KT_BF16);
    assert_int_equal(c.mode, KT_MOE_LORA);
    assert_int_equal(c.lora_rank, 8);
    assert_true(c.lora_alpha == 16.0f);
    assert_int_equal(c.keep_activations, 0);
    assert_string_equal(c.name, "blk.moe");
    assert_int_equal(c.numa_node, -1);
    assert_null(c.scratch);
    assert_int_equal(c.check_finite, 0);
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, NULL, &m)); /* what it gives is a layer */
    kt_moe_destroy(m);
    /* the rank is the adapters': outside LoRA mode it is 0 */
    OK(kt_program_moe_config(&info, 96, KT_F32, KT_MOE_FULL, 8, 16.0f, 1, &c));
    assert_int_equal(c.lora_rank, 0);
    assert_int_equal(c.max_tokens, 16);

    kt_program_moe no_router = info;
    no_router.n_experts = 0;
    kt_moe_config untouched = c;
    TU_EXPECT_ERROR(kt_program_moe_config(&no_router, 96, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 1, &c),
                    KT_EINVAL, "blk.moe", "topk_router");
    assert_memory_equal(&c, &untouched, sizeof c);
    TU_EXPECT_ERROR(kt_program_moe_config(&info, 0, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 1, &c),
                    KT_EINVAL, "intermediate");
    TU_EXPECT_ERROR(kt_program_moe_config(&info, 96, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 0, &c),
                    KT_EINVAL, "world 0");
    kt_program_moe huge = info;
    huge.tokens = INT64_MAX / 2;
    TU_EXPECT_ERROR(kt_program_moe_config(&huge, 96, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 4, &c),
                    KT_EINVAL, "overflows");
    TU_EXPECT_ERROR(kt_program_moe_config(NULL, 96, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 1, &c),
                    KT_EINVAL, "NULL");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_set_weight_says_what_differs),
        cmocka_unit_test(test_call_tensors_say_what_differs),
        cmocka_unit_test(test_failed_create_nulls_handle),
        cmocka_unit_test(test_program_moe_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
