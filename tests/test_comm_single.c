/* The single-rank communicator and the kt_comm front end: collectives are copies, messages
 * to self are rejected without poisoning, agree returns the local status, argument errors
 * leave the communicator usable; and kt_comm_create_ucx either works through its environment
 * checks or (without UCX) says it is unsupported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/core/error.h"
#include "kt/comm.h"
#include "kt/tensor.h"

static kt_comm *make(void)
{
    kt_comm *c = NULL;
    assert_int_equal(kt_comm_create_single(&c), KT_OK);
    assert_non_null(c);
    return c;
}

static void test_basics(void **state)
{
    (void)state;
    kt_comm *c = make();
    assert_int_equal(kt_comm_rank(c), 0);
    assert_int_equal(kt_comm_size(c), 1);
    assert_int_equal(kt_comm_status(c), KT_OK);
    assert_int_equal(kt_comm_set_timeout(c, 100), KT_OK);
    assert_int_equal(kt_comm_set_timeout(c, 0), KT_EINVAL);
    assert_int_equal(kt_comm_barrier(c), KT_OK);
    assert_int_equal(kt_comm_create_single(NULL), KT_EINVAL);
    assert_int_equal(kt_comm_rank(NULL), -1);
    assert_int_equal(kt_comm_size(NULL), 0);
    assert_int_equal(kt_comm_barrier(NULL), KT_EINVAL);
    kt_comm_destroy(c);
    kt_comm_destroy(NULL);
}

static void test_collectives_are_copies(void **state)
{
    (void)state;
    kt_comm *c = make();
    unsigned char a[64], b[64];
    for (int i = 0; i < 64; i++)
        a[i] = (unsigned char)(i * 7 + 1);
    memcpy(b, a, sizeof b);
    assert_int_equal(kt_comm_broadcast(c, b, sizeof b, 0), KT_OK);
    assert_memory_equal(a, b, sizeof a);
    memset(b, 0, sizeof b);
    assert_int_equal(kt_comm_all_gather(c, a, sizeof a, b), KT_OK);
    assert_memory_equal(a, b, sizeof a);
    /* in place: the send buffer is the rank's own block */
    assert_int_equal(kt_comm_all_gather(c, b, sizeof b, b), KT_OK);
    assert_memory_equal(a, b, sizeof a);
    size_t counts[1] = {40};
    memset(b, 0, sizeof b);
    assert_int_equal(kt_comm_gatherv(c, a, counts, b, 0), KT_OK);
    assert_memory_equal(a, b, 40);
    memset(b, 0, sizeof b);
    assert_int_equal(kt_comm_scatterv(c, a, counts, b, 0), KT_OK);
    assert_memory_equal(a, b, 40);
    counts[0] = 0;
    assert_int_equal(kt_comm_gatherv(c, NULL, counts, NULL, 0), KT_OK);
    assert_int_equal(kt_comm_scatterv(c, NULL, counts, NULL, 0), KT_OK);
    assert_int_equal(kt_comm_broadcast(c, NULL, 0, 0), KT_OK);

    float f[5] = {1.5f, -2.0f, 0.0f, 3.25f, 1e30f}, g[5];
    memcpy(g, f, sizeof f);
    assert_int_equal(kt_comm_all_reduce(c, g, 5, KT_F32, KT_REDUCE_SUM), KT_OK);
    assert_memory_equal(f, g, sizeof f);
    assert_int_equal(kt_comm_all_reduce(c, g, 5, KT_F32, KT_REDUCE_MEAN), KT_OK);
    assert_memory_equal(f, g, sizeof f);
    uint16_t h[5], h2[5];
    kt_f32_to_bf16(h, f, 5);
    memcpy(h2, h, sizeof h);
    assert_int_equal(kt_comm_all_reduce(c, h2, 5, KT_BF16, KT_REDUCE_MEAN), KT_OK);
    assert_memory_equal(h, h2, sizeof h);
    assert_int_equal(kt_comm_status(c), KT_OK);
    kt_comm_destroy(c);
}

static void test_invalid_arguments_do_not_poison(void **state)
{
    (void)state;
    kt_comm *c = make();
    char buf[8] = {0};
    size_t counts[1] = {8};
    assert_int_equal(kt_comm_send(c, 0, 0, buf, 8), KT_EINVAL);
    assert_non_null(strstr(kt_last_error(), "to self"));
    assert_int_equal(kt_comm_recv(c, 0, 0, buf, 8), KT_EINVAL);
    assert_int_equal(kt_comm_send(c, 1, 0, buf, 8), KT_EINVAL);
    assert_non_null(strstr(kt_last_error(), "not a rank"));
    assert_int_equal(kt_comm_send(c, 0, 70000, buf, 8), KT_EINVAL);
    assert_int_equal(kt_comm_sendrecv(c, 0, buf, 8, -1, NULL, 0, 0), KT_EINVAL);
    assert_int_equal(kt_comm_sendrecv(c, -1, NULL, 0, -1, NULL, 0, 0), KT_OK);
    assert_int_equal(kt_comm_broadcast(c, buf, 8, 1), KT_EINVAL);
    assert_int_equal(kt_comm_broadcast(c, NULL, 8, 0), KT_EINVAL);
    assert_int_equal(kt_comm_all_gather(c, buf, 8, NULL), KT_EINVAL);
    assert_int_equal(kt_comm_gatherv(c, buf, NULL, buf, 0), KT_EINVAL);
    assert_int_equal(kt_comm_gatherv(c, buf, counts, NULL, 0), KT_EINVAL);
    assert_int_equal(kt_comm_scatterv(c, NULL, counts, buf, 0), KT_EINVAL);
    assert_int_equal(kt_comm_all_reduce(c, buf, 2, KT_I32, KT_REDUCE_SUM), KT_EUNSUPPORTED);
    assert_int_equal(kt_comm_all_reduce(c, buf, 2, KT_F32, (kt_reduce_op)7), KT_EINVAL);
    assert_int_equal(kt_comm_all_reduce(c, buf, SIZE_MAX / 2, KT_F32, KT_REDUCE_SUM), KT_ERANGE);
    assert_int_equal(kt_comm_status(c), KT_OK);
    assert_int_equal(kt_comm_barrier(c), KT_OK);
    kt_comm_destroy(c);
}

static void test_agree(void **state)
{
    (void)state;
    kt_comm *c = make();
    assert_int_equal(kt_comm_agree(c, KT_OK), KT_OK);
    kt_status s = kt__error(KT_EIO, "the disk is full");
    assert_int_equal(kt_comm_agree(c, s), KT_EIO);
    assert_string_equal(kt_last_error(), "rank 0: the disk is full");
    /* a failure without a message keeps the status text */
    kt_clear_error();
    assert_int_equal(kt_comm_agree(c, KT_ERANGE), KT_ERANGE);
    assert_string_equal(kt_last_error(), "rank 0: value out of range");
    /* agreeing on a failure does not poison */
    assert_int_equal(kt_comm_status(c), KT_OK);
    assert_int_equal(kt_comm_agree(NULL, KT_OK), KT_EINVAL);
    kt_comm_destroy(c);
}

/* kt_comm_abort: this rank's failure poisons with "rank 0: <message>"; a failure agree
 * reported keeps its rank, with the caller's context after it; the first poison stays. */
static void test_abort(void **state)
{
    (void)state;
    assert_int_equal(kt_comm_abort(NULL, KT_EIO), KT_EINVAL);
    kt_comm *c = make();
    assert_int_equal(kt_comm_abort(c, KT_OK), KT_EINVAL);
    assert_int_equal(kt_comm_status(c), KT_OK); /* a wrong call does not poison */
    kt__error(KT_EIO, "step 3: loss 'l' (forward): target 9 is outside 0..7");
    assert_int_equal(kt_comm_abort(c, KT_EIO), KT_EIO);
    assert_string_equal(kt_last_error(), "rank 0: step 3: loss 'l' (forward): target 9 is "
                                         "outside 0..7");
    assert_int_equal(kt_comm_status(c), KT_EIO);
    assert_int_equal(kt_comm_barrier(c), KT_EIO);
    assert_string_equal(kt_last_error(), "rank 0: step 3: loss 'l' (forward): target 9 is "
                                         "outside 0..7");
    kt__error(KT_ERANGE, "a later failure");
    assert_int_equal(kt_comm_abort(c, KT_ERANGE), KT_EIO); /* the first one stays */
    assert_string_equal(kt_last_error(), "rank 0: step 3: loss 'l' (forward): target 9 is "
                                         "outside 0..7");
    kt_comm_destroy(c);

    c = make();
    kt__error(KT_ERANGE, "layer 'm' produced NaN");
    assert_int_equal(kt_comm_agree(c, KT_ERANGE), KT_ERANGE); /* "rank 0: layer ..." */
    kt__error_context(KT_ERANGE, "step 2: moe 'm' (forward)");
    assert_int_equal(kt_comm_abort(c, KT_ERANGE), KT_ERANGE);
    assert_string_equal(kt_last_error(), "rank 0: step 2: moe 'm' (forward): layer 'm' "
                                         "produced NaN");
    kt_comm_destroy(c);
}

static void test_create_ucx_arguments(void **state)
{
    (void)state;
    kt_comm *c = NULL;
    kt_comm_options bad = {.rank = 3, .world_size = 2};
    kt_status s = kt_comm_create_ucx(&bad, &c);
    /* Without UCX: unsupported; with it: the rank is out of range. Never a hang. */
    assert_true(s == KT_EUNSUPPORTED || s == KT_EINVAL);
    assert_null(c);
    assert_int_equal(kt_comm_create_ucx(&bad, NULL), s == KT_EUNSUPPORTED ? KT_EUNSUPPORTED
                                                                           : KT_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_basics),
        cmocka_unit_test(test_collectives_are_copies),
        cmocka_unit_test(test_invalid_arguments_do_not_poison),
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_abort),
        cmocka_unit_test(test_create_ucx_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
