/* The op table: names, arities and the rows' invariants, and clean failures for wrong input
 * counts and invalid op ids. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "lib/ops/op_desc.h"
#include "tests/support/test_util.h"

static const char *const list_names[] = {
#define NAME_OF(upper, lower) #lower,
    KT_OP_LIST(NAME_OF)
#undef NAME_OF
};

static void test_names(void **state)
{
    (void)state;
    assert_int_equal(sizeof list_names / sizeof list_names[0], KT_OP_COUNT);
    for (int i = 0; i < KT_OP_COUNT; i++) {
        const char *name = kt_op_name((kt_op)i);
        assert_non_null(name);
        assert_string_equal(name, list_names[i]);
        kt_op back = KT_OP_COUNT;
        if (kt_op_from_name(name, &back) != KT_OK)
            fail_msg("kt_op_from_name('%s'): %s", name, kt_last_error());
        assert_int_equal(back, i);
        for (int j = 0; j < i; j++)
            assert_string_not_equal(name, kt_op_name((kt_op)j));
    }
    kt_op op = KT_OP_ADD;
    TU_EXPECT_ERROR(kt_op_from_name("frobnicate", &op), KT_EINVAL, "frobnicate");
    TU_EXPECT_ERROR(kt_op_from_name("MATMUL", &op), KT_EINVAL, "MATMUL");
    TU_EXPECT_ERROR(kt_op_from_name("", &op), KT_EINVAL, "op");
    TU_EXPECT_ERROR(kt_op_from_name("matmul ", &op), KT_EINVAL, "matmul ");
    assert_int_equal(op, KT_OP_ADD); /* untouched on failure */
    TU_EXPECT_ERROR(kt_op_from_name(NULL, &op), KT_EINVAL, "NULL");
    TU_EXPECT_ERROR(kt_op_from_name("add", NULL), KT_EINVAL, "NULL");
}

/* Input and output counts as kt/ops.h documents them. */
static void test_arity(void **state)
{
    (void)state;
    static const struct {
        kt_op op;
        int min_in, max_in, n_out;
    } documented[] = {
        {KT_OP_MATMUL, 2, 2, 1},       {KT_OP_ADD, 2, 2, 1},
        {KT_OP_SUB, 2, 2, 1},          {KT_OP_MUL, 2, 2, 1},
        {KT_OP_SCALE, 1, 1, 1},        {KT_OP_SILU, 1, 1, 1},
        {KT_OP_SWIGLU, 2, 2, 1},       {KT_OP_SIGMOID, 1, 1, 1},
        {KT_OP_CLAMP, 1, 1, 1},        {KT_OP_SUM, 1, 1, 1},
        {KT_OP_MEAN, 1, 1, 1},         {KT_OP_EXPAND, 1, 1, 1},
        {KT_OP_RMSNORM, 2, 2, 1},
        {KT_OP_SOFTMAX, 1, 1, 1},      {KT_OP_LOG_SOFTMAX, 1, 1, 1},
        {KT_OP_CROSS_ENTROPY, 2, 2, 1}, {KT_OP_EMBEDDING, 2, 2, 1},
        {KT_OP_TOPK_ROUTER, 1, 2, 2},  {KT_OP_CONV1D, 2, 2, 1},
        {KT_OP_CONCAT, 1, KT_OP_MAX_IN, 1}, {KT_OP_NARROW, 1, 1, 1},
        {KT_OP_TRANSPOSE, 1, 1, 1},    {KT_OP_RESHAPE, 1, 1, 1},
        {KT_OP_MOE, 3, 3, 1},          {KT_OP_HALO, 1, 1, 1},
        {KT_OP_ROPE, 1, 2, 1},
        {KT_OP_LOAD_BALANCE_LOSS, 2, 2, 1},
        {KT_OP_ATTENTION, 3, 4, 2},
        {KT_OP_CAST, 1, 1, 1},         {KT_OP_SHIFT_LABELS, 1, 1, 1},
        {KT_OP_CP_ATTENTION, 3, 4, 2},
    };
    assert_int_equal(sizeof documented / sizeof documented[0], KT_OP_COUNT);
    for (size_t k = 0; k < sizeof documented / sizeof documented[0]; k++) {
        int mn = -1, mx = -1, no = -1;
        assert_int_equal(kt_op_arity(documented[k].op, &mn, &mx, &no), KT_OK);
        assert_true(1 <= mn && mn <= mx && mx <= KT_OP_MAX_IN);
        assert_true(1 <= no && no <= KT_OP_MAX_OUT);
        if (mn != documented[k].min_in || mx != documented[k].max_in ||
            no != documented[k].n_out)
            fail_msg("%s: arity %d..%d -> %d, kt/ops.h documents %d..%d -> %d",
                     kt_op_name(documented[k].op), mn, mx, no, documented[k].min_in,
                     documented[k].max_in, documented[k].n_out);
        /* each output pointer is optional */
        assert_int_equal(kt_op_arity(documented[k].op, NULL, NULL, NULL), KT_OK);
        int only = -1;
        assert_int_equal(kt_op_arity(documented[k].op, NULL, NULL, &only), KT_OK);
        assert_int_equal(only, no);
    }
}

static void test_rows(void **state)
{
    (void)state;
    for (int i = 0; i < KT_OP_COUNT; i++) {
        const kt__op_desc *d = kt__op_get((kt_op)i);
        assert_non_null(d);
        const char *name = list_names[i];
        assert_non_null(d->name);
        assert_string_equal(d->name, name);
        if (d->infer == NULL || d->forward == NULL || d->backward == NULL)
            fail_msg("%s: infer, forward and backward must all be set", name);
        assert_true(1 <= d->min_in && d->min_in <= d->max_in && d->max_in <= KT_OP_MAX_IN);
        assert_true(1 <= d->n_out && d->n_out <= KT_OP_MAX_OUT);
        const unsigned in_mask = (1u << d->max_in) - 1, out_mask = (1u << d->n_out) - 1;
        if (d->bwd_reads_in & ~in_mask)
            fail_msg("%s: bwd_reads_in 0x%x names inputs beyond %d", name, d->bwd_reads_in,
                     d->max_in);
        if (d->no_grad_in & ~in_mask)
            fail_msg("%s: no_grad_in 0x%x names inputs beyond %d", name, d->no_grad_in,
                     d->max_in);
        if (d->inplace_in & ~in_mask)
            fail_msg("%s: inplace_in 0x%x names inputs beyond %d", name, d->inplace_in,
                     d->max_in);
        if (d->bwd_reads_out & ~out_mask)
            fail_msg("%s: bwd_reads_out 0x%x names outputs beyond %d", name, d->bwd_reads_out,
                     d->n_out);
    }
    assert_null(kt__op_get(KT_OP_COUNT));
    assert_null(kt__op_get((kt_op)-1));
    assert_null(kt__op_get((kt_op)1000));
}

/* Wrong input or output counts fail before any kernel runs, naming the op. */
static void test_wrong_counts(void **state)
{
    (void)state;
    kt_tensor in[KT_OP_MAX_IN + 1], out[KT_OP_MAX_OUT + 1];
    for (int i = 0; i <= KT_OP_MAX_IN; i++)
        assert_int_equal(kt_tensor_init(&in[i], NULL, KT_F32, 2, TU_SHAPE(4, 4)), KT_OK);
    for (int i = 0; i < KT_OP_COUNT; i++) {
        const char *name = list_names[i];
        int mn, mx, no;
        assert_int_equal(kt_op_arity((kt_op)i, &mn, &mx, &no), KT_OK);
        TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, in, mx + 1, out, no), KT_EINVAL, name,
                        "input");
        TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, in, mn - 1, out, no), KT_EINVAL, name,
                        "input");
        TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, in, mn, out, no + 1), KT_EINVAL, name,
                        "output");
        if (no > 1)
            TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, in, mn, out, no - 1), KT_EINVAL, name,
                            "output");
        TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, in, mn, NULL, no), KT_EINVAL, name,
                        "output");
        TU_EXPECT_ERROR(kt_op_infer((kt_op)i, NULL, NULL, mn, out, no), KT_EINVAL, name,
                        "input");
        TU_EXPECT_ERROR(kt_op_forward((kt_op)i, NULL, in, mx + 1, out, no, NULL), KT_EINVAL,
                        name, "input");
        TU_EXPECT_ERROR(kt_op_backward((kt_op)i, NULL, in, mx + 1, out, no, out, in, NULL),
                        KT_EINVAL, name, "input");
        TU_EXPECT_ERROR(kt_op_backward((kt_op)i, NULL, in, mn, NULL, no, out, in, NULL),
                        KT_EINVAL, name, "NULL");
    }
}

static void test_invalid_op(void **state)
{
    (void)state;
    const kt_op bad[] = {KT_OP_COUNT, (kt_op)-1, (kt_op)12345};
    kt_tensor in[2], out[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(kt_tensor_init(&in[i], NULL, KT_F32, 1, TU_SHAPE(3)), KT_OK);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        assert_string_equal(kt_op_name(bad[k]), "?");
        int mn = 7;
        TU_EXPECT_ERROR(kt_op_arity(bad[k], &mn, NULL, NULL), KT_EINVAL, "invalid op");
        assert_int_equal(mn, 7);
        TU_EXPECT_ERROR(kt_op_infer(bad[k], NULL, in, 1, out, 1), KT_EINVAL, "invalid op");
        TU_EXPECT_ERROR(kt_op_forward(bad[k], NULL, in, 1, out, 1, NULL), KT_EINVAL,
                        "invalid op");
        TU_EXPECT_ERROR(kt_op_backward(bad[k], NULL, in, 1, out, 1, out, in, NULL), KT_EINVAL,
                        "invalid op");
        assert_int_equal(kt_op_scratch_bytes(bad[k], NULL, in, 1, 0), 0);
        assert_int_equal(kt_op_scratch_bytes(bad[k], NULL, in, 1, 1), 0);
        assert_true(kt_op_flops(bad[k], NULL, in, 1) == 0.0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),        cmocka_unit_test(test_arity),
        cmocka_unit_test(test_rows),         cmocka_unit_test(test_wrong_counts),
        cmocka_unit_test(test_invalid_op),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
