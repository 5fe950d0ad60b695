/* The runtime core: status codes and the thread-local last error, tensors and views, dtype
 * names, arenas, NUMA placement, version, CPU features and the CUDA device count. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/core/error.h"
#include "tests/support/test_util.h"

/* ---- status codes and errors ------------------------------------------------------------ */

static void test_status_codes(void **state)
{
    (void)state;
    static const struct {
        kt_status code;
        int value;
        const char *text;
    } expected[] = {
        {KT_OK, 0, "success"},
        {KT_EINVAL, -1, "invalid argument"},
        {KT_ENOMEM, -2, "out of memory"},
        {KT_ERANGE, -3, "value out of range"},
        {KT_EIO, -4, "input/output error"},
        {KT_EFORMAT, -5, "malformed or corrupt data"},
        {KT_EUNSUPPORTED, -6, "not supported by this build or machine"},
        {KT_ETIMEDOUT, -7, "timed out"},
        {KT_EPEER, -8, "peer failed"},
        {KT_ESTATE, -9, "object is in a failed or wrong state"},
        {KT_EINTERNAL, -10, "internal error"},
    };
    const size_t n = sizeof expected / sizeof expected[0];
    /* the table above covers the whole list */
    size_t listed = 0;
#define COUNT_STATUS(name, value, text) listed++;
    KT_STATUS_LIST(COUNT_STATUS)
#undef COUNT_STATUS
    assert_int_equal(listed, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal((int)expected[i].code, expected[i].value);
        assert_string_equal(kt_status_str(expected[i].code), expected[i].text);
    }
    /* every name is distinct and none is the fallback */
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            assert_string_not_equal(kt_status_str(expected[i].code),
                                    kt_status_str(expected[j].code));
    assert_string_equal(kt_status_str((kt_status)-99), "unknown status");
    assert_string_equal(kt_status_str((kt_status)1), "unknown status");
}

static void test_last_error(void **state)
{
    (void)state;
    kt_clear_error();
    assert_string_equal(kt_last_error(), "");
    kt_tensor t;
    TU_EXPECT_ERROR(kt_tensor_init(&t, NULL, (kt_dtype)42, 1, TU_SHAPE(3)), KT_EINVAL,
                    "kt_tensor_init", "dtype 42");
    /* a success does not clear the message; the next failure replaces it */
    assert_int_equal(kt_tensor_init(&t, NULL, KT_F32, 1, TU_SHAPE(3)), KT_OK);
    assert_non_null(strstr(kt_last_error(), "dtype 42"));
    TU_EXPECT_ERROR(kt_tensor_init(&t, NULL, KT_F32, 5, TU_SHAPE(1, 1, 1, 1, 1)), KT_EINVAL,
                    "ndim 5");
    assert_null(strstr(kt_last_error(), "dtype 42"));
    kt_clear_error();
    assert_string_equal(kt_last_error(), "");
    /* an application's own failure, also formatted from the last message itself */
    assert_int_equal(kt_set_error(KT_EIO, "app: %d files", 3), KT_EIO);
    assert_string_equal(kt_last_error(), "app: 3 files");
    assert_int_equal(kt_set_error(KT_EINVAL, "outer: %s", kt_last_error()), KT_EINVAL);
    assert_string_equal(kt_last_error(), "outer: app: 3 files");
    kt_clear_error();
}

typedef struct thread_probe {
    char seen_at_start[256];
    char own[256];
} thread_probe;

static void *error_thread(void *arg)
{
    thread_probe *p = arg;
    snprintf(p->seen_at_start, sizeof p->seen_at_start, "%s", kt_last_error());
    kt_dtype d;
    (void)kt_dtype_from_name("not-a-dtype", &d);
    snprintf(p->own, sizeof p->own, "%s", kt_last_error());
    return NULL;
}

/* The message lives in thread-local storage: a second thread neither sees this thread's
 * message nor replaces it. */
static void test_last_error_thread_local(void **state)
{
    (void)state;
    kt_tensor t;
    assert_int_equal(kt_tensor_init(&t, NULL, KT_F32, 1, TU_SHAPE(-7)), KT_EINVAL);
    char mine[256];
    snprintf(mine, sizeof mine, "%s", kt_last_error());
    assert_non_null(strstr(mine, "-7"));
    thread_probe probe;
    memset(&probe, 0, sizeof probe);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, error_thread, &probe), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_string_equal(probe.seen_at_start, "");
    assert_non_null(strstr(probe.own, "not-a-dtype"));
    assert_string_equal(kt_last_error(), mine);
}

static void test_error_context(void **state)
{
    (void)state;
    assert_int_equal(kt__error(KT_EIO, "cannot read %s at %d", "a.bin", 12), KT_EIO);
    assert_string_equal(kt_last_error(), "cannot read a.bin at 12");
    assert_int_equal(kt__error_context(KT_EIO, "node %d", 3), KT_EIO);
    assert_string_equal(kt_last_error(), "node 3: cannot read a.bin at 12");
    assert_int_equal(kt__error_context(KT_EIO, "step %s", "fwd"), KT_EIO);
    assert_string_equal(kt_last_error(), "step fwd: node 3: cannot read a.bin at 12");
    /* with no message underneath, the status's description stands in */
    kt_clear_error();
    assert_int_equal(kt__error_context(KT_ETIMEDOUT, "rank %d", 1), KT_ETIMEDOUT);
    assert_string_equal(kt_last_error(), "rank 1: timed out");
    /* a message beyond the buffer keeps its reason: an overlong word (a name) is cut to its
     * start and end first */
    char big[3000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    kt__error(KT_EINVAL, "%s: tensor '%s' is not a parameter of the program", "p.safetensors",
              big);
    const char *m = kt_last_error();
    assert_true(strlen(m) < 200);
    assert_memory_equal(m, "p.safetensors: tensor 'xxxx", 27);
    assert_non_null(strstr(m, "xxx...xxx"));
    assert_non_null(strstr(m, "' is not a parameter of the program"));
    kt__error_context(KT_EINVAL, "ctx");
    assert_memory_equal(kt_last_error(), "ctx: p.safetensors", 18);
    /* prose alone longer than the buffer is cut at its end, NUL-terminated, never overflows */
    char words[3000];
    for (size_t i = 0; i + 1 < sizeof words; i++)
        words[i] = i % 5 == 4 ? ' ' : 'w';
    words[sizeof words - 1] = '\0';
    kt__error(KT_EINVAL, "%s", words);
    size_t len = strlen(kt_last_error());
    assert_true(len > 900 && len < 1024);
    assert_string_equal(kt_last_error() + len - 3, "...");
    kt__error_context(KT_EINVAL, "%s", words);
    assert_true(strlen(kt_last_error()) < 1024);
    /* bytes that are not UTF-8, and control characters, are stored escaped; UTF-8 as it is */
    kt__error(KT_EINVAL, "name '%s' and '%s'", "a\xff\x1b[2Jb", "gr\xc3\xb6\xc3\x9f" "e");
    assert_string_equal(kt_last_error(), "name 'a\\xff\\x1b[2Jb' and 'gr\xc3\xb6\xc3\x9f" "e'");
    kt__error(KT_EINVAL, "%s", "\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82"); /* invalid forms */
    assert_string_equal(kt_last_error(), "\\xc0\\xaf \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80 \\xe2\\x82");
    /* the KT__TRY macro passes a failure through */
    kt_clear_error();
}

static kt_status try_twice(int fail_second, int *reached)
{
    KT__TRY(KT_OK);
    *reached = 1;
    KT__TRY(fail_second ? kt__error(KT_ERANGE, "second") : KT_OK);
    *reached = 2;
    return KT_OK;
}

static void test_try_macro(void **state)
{
    (void)state;
    int reached = 0;
    assert_int_equal(try_twice(0, &reached), KT_OK);
    assert_int_equal(reached, 2);
    reached = 0;
    assert_int_equal(try_twice(1, &reached), KT_ERANGE);
    assert_int_equal(reached, 1);
    assert_string_equal(kt_last_error(), "second");
}

/* ---- tensors -------------------------------------------------------------------------------- */

static void test_tensor_init(void **state)
{
    (void)state;
    float buf[24];
    kt_tensor t;
    assert_int_equal(kt_tensor_init(&t, buf, KT_F32, 3, TU_SHAPE(2, 3, 4)), KT_OK);
    assert_ptr_equal(t.data, buf);
    assert_int_equal(t.dtype, KT_F32);
    assert_int_equal(t.ndim, 3);
    assert_true(t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1);
    assert_int_equal(t.device.type, KT_DEVICE_CPU);
    assert_int_equal(t.device.index, 0);
    assert_int_equal(kt_tensor_numel(&t), 24);
    assert_int_equal(kt_tensor_nbytes(&t), 96);
    assert_true(kt_tensor_is_contiguous(&t));
    char d[64];
    assert_string_equal(kt_tensor_describe(&t, d, sizeof d), "f32[2,3,4]");

    kt_tensor s;
    assert_int_equal(kt_tensor_init(&s, NULL, KT_I64, 0, NULL), KT_OK);
    assert_int_equal(kt_tensor_numel(&s), 1);
    assert_int_equal(kt_tensor_nbytes(&s), 8);
    assert_true(kt_tensor_is_contiguous(&s));
    assert_string_equal(kt_tensor_describe(&s, d, sizeof d), "i64[]");

    kt_tensor e;
    assert_int_equal(kt_tensor_init(&e, NULL, KT_BF16, 2, TU_SHAPE(5, 0)), KT_OK);
    assert_int_equal(kt_tensor_numel(&e), 0);
    assert_int_equal(kt_tensor_nbytes(&e), 0);
    assert_string_equal(kt_tensor_describe(&e, d, sizeof d), "bf16[5,0]");

    /* describe cuts to the buffer and always terminates */
    char small[6];
    memset(small, '#', sizeof small);
    kt_tensor_describe(&t, small, sizeof small);
    assert_string_equal(small, "f32[2");
    char one[1] = {'#'};
    kt_tensor_describe(&t, one, 1);
    assert_int_equal(one[0], '\0');
    char none[1] = {'#'};
    assert_ptr_equal(kt_tensor_describe(&t, none, 0), none);
    assert_int_equal(none[0], '#');

    /* same_shape looks at ndim and shape only */
    kt_tensor u;
    assert_int_equal(kt_tensor_init(&u, NULL, KT_I32, 3, TU_SHAPE(2, 3, 4)), KT_OK);
    assert_true(kt_tensor_same_shape(&t, &u));
    assert_int_equal(kt_tensor_init(&u, NULL, KT_F32, 2, TU_SHAPE(2, 3)), KT_OK);
    assert_false(kt_tensor_same_shape(&t, &u));
    assert_int_equal(kt_tensor_init(&u, NULL, KT_F32, 3, TU_SHAPE(2, 3, 5)), KT_OK);
    assert_false(kt_tensor_same_shape(&t, &u));

    /* failures leave the tensor untouched */
    kt_tensor keep = t;
    TU_EXPECT_ERROR(kt_tensor_init(&t, buf, KT_DTYPE_COUNT, 1, TU_SHAPE(2)), KT_EINVAL,
                    "kt_tensor_init", "dtype");
    TU_EXPECT_ERROR(kt_tensor_init(&t, buf, KT_F32, -1, TU_SHAPE(2)), KT_EINVAL, "ndim -1");
    TU_EXPECT_ERROR(kt_tensor_init(&t, buf, KT_F32, KT_MAX_DIMS + 1, TU_SHAPE(1, 1, 1, 1, 1)),
                    KT_EINVAL, "ndim 5");
    TU_EXPECT_ERROR(kt_tensor_init(&t, buf, KT_F32, 2, TU_SHAPE(3, -2)), KT_EINVAL,
                    "dimension 1", "-2");
    TU_EXPECT_ERROR(kt_tensor_init(&t, buf, KT_F32, 2, NULL), KT_EINVAL, "shape");
    assert_memory_equal(&t, &keep, sizeof t);
    TU_EXPECT_ERROR(kt_tensor_init(NULL, buf, KT_F32, 1, TU_SHAPE(2)), KT_EINVAL,
                    "kt_tensor_init");
}

static void test_tensor_narrow(void **state)
{
    (void)state;
    int32_t buf[2 * 8 * 3];
    kt_tensor t, v;
    assert_int_equal(kt_tensor_init(&t, buf, KT_I32, 3, TU_SHAPE(2, 8, 3)), KT_OK);
    assert_int_equal(kt_tensor_narrow(&t, 1, 3, 4, &v), KT_OK);
    assert_ptr_equal(v.data, buf + 3 * 3);
    assert_true(v.shape[0] == 2 && v.shape[1] == 4 && v.shape[2] == 3);
    assert_true(v.strides[0] == 24 && v.strides[1] == 3 && v.strides[2] == 1);
    assert_false(kt_tensor_is_contiguous(&v));
    assert_int_equal(kt_tensor_numel(&v), 24);
    /* along dim 0 the view stays contiguous */
    assert_int_equal(kt_tensor_narrow(&t, 0, 1, 1, &v), KT_OK);
    assert_ptr_equal(v.data, buf + 24);
    assert_true(kt_tensor_is_contiguous(&v));
    /* the last element, and an empty range at the end */
    assert_int_equal(kt_tensor_narrow(&t, 2, 2, 1, &v), KT_OK);
    assert_ptr_equal(v.data, buf + 2);
    assert_int_equal(kt_tensor_narrow(&t, 1, 8, 0, &v), KT_OK);
    assert_int_equal(kt_tensor_numel(&v), 0);
    /* a view of a narrowed view accumulates the offset */
    kt_tensor w;
    assert_int_equal(kt_tensor_narrow(&t, 1, 2, 5, &v), KT_OK);
    assert_int_equal(kt_tensor_narrow(&v, 1, 1, 2, &w), KT_OK);
    assert_ptr_equal(w.data, buf + 3 * 3);
    /* a shape-only tensor stays without data */
    kt_tensor d;
    assert_int_equal(kt_tensor_init(&d, NULL, KT_F32, 2, TU_SHAPE(4, 4)), KT_OK);
    assert_int_equal(kt_tensor_narrow(&d, 0, 2, 2, &v), KT_OK);
    assert_null(v.data);

    kt_tensor keep = v;
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 1, 3, 6, &v), KT_EINVAL,
                    "narrow: range [3, 9) outside dim 1 of size 8");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 1, -1, 2, &v), KT_EINVAL, "narrow", "[-1, 1)");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 0, 0, -1, &v), KT_EINVAL, "narrow", "dim 0");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 3, 0, 1, &v), KT_EINVAL, "narrow", "dim 3");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, -1, 0, 1, &v), KT_EINVAL, "narrow", "dim -1");
    /* ranges whose end does not fit in int64 are refused, not wrapped */
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 1, INT64_MAX, 1, &v), KT_EINVAL, "narrow", "range");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 1, 1, INT64_MAX, &v), KT_EINVAL, "narrow", "range");
    TU_EXPECT_ERROR(kt_tensor_narrow(&t, 1, INT64_MIN, -1, &v), KT_EINVAL, "narrow", "range");
    assert_memory_equal(&v, &keep, sizeof v);
}

static void test_tensor_transpose(void **state)
{
    (void)state;
    uint16_t buf[2 * 3 * 5];
    kt_tensor t, v, back;
    assert_int_equal(kt_tensor_init(&t, buf, KT_BF16, 3, TU_SHAPE(2, 3, 5)), KT_OK);
    assert_int_equal(kt_tensor_transpose(&t, 0, 2, &v), KT_OK);
    assert_ptr_equal(v.data, buf);
    assert_true(v.shape[0] == 5 && v.shape[1] == 3 && v.shape[2] == 2);
    assert_true(v.strides[0] == 1 && v.strides[1] == 5 && v.strides[2] == 15);
    assert_false(kt_tensor_is_contiguous(&v));
    assert_int_equal(kt_tensor_transpose(&v, 2, 0, &back), KT_OK);
    assert_memory_equal(back.shape, t.shape, sizeof t.shape);
    assert_memory_equal(back.strides, t.strides, sizeof t.strides);
    assert_true(kt_tensor_is_contiguous(&back));
    /* a dim with itself changes nothing; size-1 dims do not break contiguity */
    assert_int_equal(kt_tensor_transpose(&t, 1, 1, &v), KT_OK);
    assert_memory_equal(&v, &t, sizeof t);
    kt_tensor o;
    assert_int_equal(kt_tensor_init(&o, buf, KT_BF16, 3, TU_SHAPE(1, 6, 1)), KT_OK);
    assert_int_equal(kt_tensor_transpose(&o, 0, 2, &v), KT_OK);
    assert_true(kt_tensor_is_contiguous(&v));

    TU_EXPECT_ERROR(kt_tensor_transpose(&t, 0, 3, &v), KT_EINVAL, "transpose", "(0, 3)");
    TU_EXPECT_ERROR(kt_tensor_transpose(&t, -1, 1, &v), KT_EINVAL, "transpose", "(-1, 1)");
}

static void test_tensor_reshape(void **state)
{
    (void)state;
    float buf[24];
    kt_tensor t, v;
    assert_int_equal(kt_tensor_init(&t, buf, KT_F32, 3, TU_SHAPE(2, 3, 4)), KT_OK);
    assert_int_equal(kt_tensor_reshape(&t, 2, TU_SHAPE(6, -1), &v), KT_OK);
    assert_ptr_equal(v.data, buf);
    assert_true(v.ndim == 2 && v.shape[0] == 6 && v.shape[1] == 4);
    assert_true(v.strides[0] == 4 && v.strides[1] == 1);
    assert_int_equal(kt_tensor_reshape(&t, 4, TU_SHAPE(-1, 2, 2, 3), &v), KT_OK);
    assert_true(v.shape[0] == 2);
    assert_int_equal(kt_tensor_reshape(&t, 1, TU_SHAPE(24), &v), KT_OK);
    assert_int_equal(v.strides[0], 1);
    /* the device travels with the view */
    kt_tensor dev = t;
    dev.device.index = 3;
    assert_int_equal(kt_tensor_reshape(&dev, 1, TU_SHAPE(-1), &v), KT_OK);
    assert_int_equal(v.device.index, 3);
    /* a one-element tensor to a scalar */
    kt_tensor one;
    assert_int_equal(kt_tensor_init(&one, buf, KT_F32, 2, TU_SHAPE(1, 1)), KT_OK);
    assert_int_equal(kt_tensor_reshape(&one, 0, NULL, &v), KT_OK);
    assert_int_equal(v.ndim, 0);

    kt_tensor keep = v;
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(5, 5), &v), KT_EINVAL, "reshape",
                    "24 elements", "25");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(-1, -1), &v), KT_EINVAL, "reshape",
                    "more than one");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(5, -1), &v), KT_EINVAL, "reshape",
                    "dimension 1");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(0, -1), &v), KT_EINVAL, "reshape");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(-3, -8), &v), KT_EINVAL, "reshape",
                    "negative");
    /* found by fuzz_program_load: the product of the dimensions overflowed int64 */
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 2, TU_SHAPE(4, 3314649325744685064), &v), KT_EINVAL,
                    "reshape", "overflows");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 3, TU_SHAPE(INT64_MAX, 2, -1), &v), KT_EINVAL,
                    "reshape", "overflows");
    TU_EXPECT_ERROR(kt_tensor_reshape(&t, 5, TU_SHAPE(1, 1, 2, 3, 4), &v), KT_EINVAL,
                    "reshape", "ndim 5");
    kt_tensor tr;
    assert_int_equal(kt_tensor_transpose(&t, 0, 1, &tr), KT_OK);
    TU_EXPECT_ERROR(kt_tensor_reshape(&tr, 1, TU_SHAPE(-1), &v), KT_EINVAL, "reshape",
                    "not contiguous");
    assert_memory_equal(&v, &keep, sizeof v);
}

static void test_dtypes(void **state)
{
    (void)state;
    static const struct {
        kt_dtype d;
        const char *name, *upper;
        size_t size;
    } all[] = {{KT_F32, "f32", "F32", 4},
               {KT_BF16, "bf16", "BF16", 2},
               {KT_F16, "f16", "F16", 2},
               {KT_I32, "i32", "I32", 4},
               {KT_I64, "i64", "I64", 8}};
    assert_int_equal(KT_DTYPE_COUNT, 5);
    for (int i = 0; i < 5; i++) {
        assert_string_equal(kt_dtype_name(all[i].d), all[i].name);
        assert_int_equal(kt_dtype_size(all[i].d), all[i].size);
        kt_dtype got = KT_DTYPE_COUNT;
        assert_int_equal(kt_dtype_from_name(all[i].name, &got), KT_OK);
        assert_int_equal(got, all[i].d);
        got = KT_DTYPE_COUNT;
        assert_int_equal(kt_dtype_from_name(all[i].upper, &got), KT_OK);
        assert_int_equal(got, all[i].d);
    }
    assert_string_equal(kt_dtype_name(KT_DTYPE_COUNT), "?");
    assert_string_equal(kt_dtype_name((kt_dtype)-1), "?");
    assert_int_equal(kt_dtype_size(KT_DTYPE_COUNT), 0);
    assert_int_equal(kt_dtype_size((kt_dtype)-1), 0);
    kt_dtype d = KT_I32;
    TU_EXPECT_ERROR(kt_dtype_from_name("bfloat16", &d), KT_EINVAL, "bfloat16");
    TU_EXPECT_ERROR(kt_dtype_from_name("Bf16", &d), KT_EINVAL, "Bf16");
    TU_EXPECT_ERROR(kt_dtype_from_name("", &d), KT_EINVAL, "dtype");
    assert_int_equal(d, KT_I32);
    TU_EXPECT_ERROR(kt_dtype_from_name(NULL, &d), KT_EINVAL, "NULL");
    TU_EXPECT_ERROR(kt_dtype_from_name("f32", NULL), KT_EINVAL, "NULL");
}

/* ---- arenas ----------------------------------------------------------------------------------- */

static void test_arena_alignment(void **state)
{
    (void)state;
    kt_arena a;
    assert_int_equal(kt_arena_create(&a, 1 << 16, -1), KT_OK);
    assert_non_null(a.base);
    assert_int_equal((uintptr_t)a.base % 64, 0);
    assert_int_equal(a.size, 1 << 16);
    assert_int_equal(a.used, 0);
    assert_int_equal(a.owned, 1);
    assert_int_equal(a.numa_node, -1);
    const size_t aligns[] = {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 4096};
    const size_t sizes[] = {1, 3, 7, 0, 13, 64, 5};
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < sizeof aligns / sizeof aligns[0]; i++) {
            size_t want = aligns[i] ? aligns[i] : 64;
            size_t bytes = sizes[(i + (size_t)round) % (sizeof sizes / sizeof sizes[0])];
            void *p = NULL;
            size_t before = a.used;
            assert_int_equal(kt_arena_alloc(&a, bytes, aligns[i], &p), KT_OK);
            assert_non_null(p);
            if ((uintptr_t)p % want != 0)
                fail_msg("allocation of %zu bytes aligned to %zu is at %p", bytes, want, p);
            assert_true((unsigned char *)p >= a.base + before);
            assert_true((unsigned char *)p + bytes == a.base + a.used);
            assert_true(a.used <= a.size);
            memset(p, 0x5a, bytes); /* in bounds: ASan would say otherwise */
        }
    }
    assert_int_equal(a.high_water, a.used);
    assert_int_equal(kt_arena_available(&a), a.size - a.used);
    kt_arena_destroy(&a);
    assert_null(a.base);
    assert_int_equal(a.size, 0);
    kt_arena_destroy(&a); /* twice is harmless */
    kt_arena zero;
    memset(&zero, 0, sizeof zero);
    kt_arena_destroy(&zero);
}

static void test_arena_exhaustion(void **state)
{
    (void)state;
    kt_arena a;
    assert_int_equal(kt_arena_create(&a, 1000, -1), KT_OK);
    void *p = NULL, *q = NULL;
    assert_int_equal(kt_arena_alloc(&a, 600, 8, &p), KT_OK);
    kt_arena before = a;
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 500, 8, &q), KT_ENOMEM, "requested 500", "400 available");
    assert_memory_equal(&a, &before, sizeof a);
    assert_null(q);
    /* padding counts against what is available: 600 -> 640 leaves 360 */
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 361, 64, &q), KT_ENOMEM, "requested 361", "360 available");
    assert_memory_equal(&a, &before, sizeof a);
    /* sizes that would wrap around are refused */
    TU_EXPECT_ERROR(kt_arena_alloc(&a, SIZE_MAX, 1, &q), KT_ENOMEM, "requested");
    TU_EXPECT_ERROR(kt_arena_alloc(&a, SIZE_MAX - 500, 4096, &q), KT_ENOMEM, "requested");
    assert_memory_equal(&a, &before, sizeof a);
    /* exactly the rest fits, then nothing more (but zero bytes still do) */
    assert_int_equal(kt_arena_alloc(&a, 400, 8, &q), KT_OK);
    assert_int_equal(kt_arena_available(&a), 0);
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 1, 1, &q), KT_ENOMEM, "requested 1", "0 available");
    assert_int_equal(kt_arena_alloc(&a, 0, 1, &q), KT_OK);
    /* bad alignment and NULL arguments */
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 8, 3, &q), KT_EINVAL, "alignment 3");
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 8, 48, &q), KT_EINVAL, "alignment 48");
    TU_EXPECT_ERROR(kt_arena_alloc(NULL, 8, 8, &q), KT_EINVAL, "kt_arena_alloc");
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 8, 8, NULL), KT_EINVAL, "kt_arena_alloc");
    kt_arena_destroy(&a);
}

static void test_arena_mark_reset(void **state)
{
    (void)state;
    kt_arena a;
    assert_int_equal(kt_arena_create(&a, 4096, -1), KT_OK);
    void *p, *q, *r;
    assert_int_equal(kt_arena_alloc(&a, 100, 0, &p), KT_OK);
    size_t mark = kt_arena_mark(&a);
    assert_int_equal(mark, 100);
    assert_int_equal(kt_arena_alloc(&a, 1000, 0, &q), KT_OK);
    assert_int_equal(kt_arena_alloc(&a, 2000, 0, &r), KT_OK);
    size_t peak = a.used;
    assert_int_equal(a.high_water, peak);
    assert_int_equal(kt_arena_reset(&a, mark), KT_OK);
    assert_int_equal(a.used, mark);
    assert_int_equal(a.high_water, peak); /* the peak is remembered */
    /* the same requests after a reset land at the same addresses */
    void *q2;
    assert_int_equal(kt_arena_alloc(&a, 1000, 0, &q2), KT_OK);
    assert_ptr_equal(q2, q);
    assert_int_equal(a.high_water, peak);
    TU_EXPECT_ERROR(kt_arena_reset(&a, a.used + 1), KT_EINVAL, "mark");
    assert_int_equal(kt_arena_reset(&a, 0), KT_OK);
    assert_int_equal(kt_arena_available(&a), 4096);
    kt_arena_destroy(&a);
}

static void test_arena_init_buffer(void **state)
{
    (void)state;
    /* caller memory, deliberately misaligned: destroy must not free it */
    _Alignas(64) unsigned char mem[1024 + 64];
    unsigned char *buf = mem + 3;
    kt_arena a;
    assert_int_equal(kt_arena_init_buffer(&a, buf, 1024), KT_OK);
    assert_ptr_equal(a.base, buf);
    assert_int_equal(a.owned, 0);
    assert_int_equal(a.numa_node, -1);
    void *p;
    assert_int_equal(kt_arena_alloc(&a, 10, 64, &p), KT_OK);
    assert_int_equal((uintptr_t)p % 64, 0);
    assert_ptr_equal(p, mem + 64);
    assert_int_equal(a.used, 61 + 10);
    assert_int_equal(kt_arena_alloc(&a, 1, 1, &p), KT_OK);
    assert_ptr_equal(p, mem + 74);
    /* 1024 - 72 = 952 left; a 953-byte request fails, 952 fits */
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 953, 1, &p), KT_ENOMEM, "953", "952 available");
    assert_int_equal(kt_arena_alloc(&a, 952, 1, &p), KT_OK);
    kt_arena_destroy(&a);
    assert_null(a.base);
    /* an empty arena over no memory hands out only empty allocations */
    assert_int_equal(kt_arena_init_buffer(&a, NULL, 0), KT_OK);
    TU_EXPECT_ERROR(kt_arena_alloc(&a, 1, 1, &p), KT_ENOMEM, "requested 1");
    kt_arena_destroy(&a);
    TU_EXPECT_ERROR(kt_arena_init_buffer(&a, NULL, 16), KT_EINVAL, "kt_arena_init_buffer");
    TU_EXPECT_ERROR(kt_arena_init_buffer(NULL, buf, 16), KT_EINVAL, "kt_arena_init_buffer");
}

static void test_arena_numa(void **state)
{
    (void)state;
    int nodes = kt_numa_node_count();
    assert_true(nodes >= 1);
    int avail = kt_numa_available();
    assert_true(avail == 0 || avail == 1);
    print_message("NUMA: available %d, %d node(s)\n", avail, nodes);
    const int ok_nodes[] = {-1, 0};
    for (int i = 0; i < 2; i++) {
        kt_arena a;
        assert_int_equal(kt_arena_create(&a, 8192, ok_nodes[i]), KT_OK);
        assert_int_equal(a.numa_node, ok_nodes[i]);
        void *p;
        assert_int_equal(kt_arena_alloc(&a, 8192, 0, &p), KT_OK);
        memset(p, 1, 8192);
        kt_arena_destroy(&a);
    }
    kt_arena a;
    memset(&a, 0x77, sizeof a);
    kt_arena keep = a;
    TU_EXPECT_ERROR(kt_arena_create(&a, 4096, 99), KT_EINVAL, "NUMA node 99");
    TU_EXPECT_ERROR(kt_arena_create(&a, 4096, -2), KT_EINVAL, "NUMA node -2");
    assert_memory_equal(&a, &keep, sizeof a); /* untouched on failure */
    TU_EXPECT_ERROR(kt_arena_create(NULL, 4096, -1), KT_EINVAL, "kt_arena_create");
    /* an empty owned arena */
    assert_int_equal(kt_arena_create(&a, 0, -1), KT_OK);
    void *p;
    assert_int_equal(kt_arena_alloc(&a, 0, 0, &p), KT_OK);
    kt_arena_destroy(&a);
}

/* ---- version, CPU, CUDA ------------------------------------------------------------------- */

static void test_version_and_machine(void **state)
{
    (void)state;
    assert_int_equal(kt_version(), KT_VERSION_HEX);
    assert_string_equal(kt_version_string(), KT_VERSION_STRING);
    char v[32];
    snprintf(v, sizeof v, "%d.%d.%d", KT_VERSION_MAJOR, KT_VERSION_MINOR, KT_VERSION_PATCH);
    assert_string_equal(kt_version_string(), v);
    assert_int_equal(KT_VERSION_HEX,
                     (KT_VERSION_MAJOR << 16) | (KT_VERSION_MINOR << 8) | KT_VERSION_PATCH);
    assert_non_null(kt_build_features());

    const char *cpu = kt_cpu_describe();
    assert_non_null(cpu);
    assert_true(strlen(cpu) > 0);
    const kt_cpu_features *f = kt_cpu_get_features();
    assert_non_null(f);
    assert_ptr_equal(f, kt_cpu_get_features());
    assert_true(!f->avx512bw || f->avx512f);
    assert_true(!f->avx512_bf16 || f->avx512f);
    assert_true(!f->amx_usable || f->amx_tile);
    if (f->avx512f)
        assert_non_null(strstr(cpu, "avx512f"));
    print_message("CPU: %s; build: '%s'\n", cpu, kt_build_features());

    int gpus = kt_cuda_device_count();
    assert_true(gpus >= 0);
    assert_int_equal(kt_cuda_device_count(), gpus);
    if (gpus == 0)
        print_message("no CUDA device (or a build without CUDA): CUDA runtime checks "
                      "skipped\n");
    else
        print_message("%d CUDA device(s)\n", gpus);
}

/* ---- environment and memory ------------------------------------------------------------- */

/* Sets NAME=value, checks kt_check_environment's verdict, and unsets it again. */
static void expect_env(const char *name, const char *value, int ok)
{
    assert_int_equal(setenv(name, value, 1), 0);
    if (ok)
        assert_int_equal(kt_check_environment(), KT_OK);
    else
        TU_EXPECT_ERROR(kt_check_environment(), KT_EINVAL, name, value);
    assert_int_equal(unsetenv(name), 0);
}

static void test_environment_strict(void **state)
{
    (void)state;
    assert_int_equal(kt_check_environment(), KT_OK);
    expect_env("KT_CPU", "portable", 1);
    expect_env("KT_CPU", "blas", 1);
    expect_env("KT_CPU", "portabel", 0);
    expect_env("KT_CPU", "PORTABLE", 0);
    expect_env("KT_NUM_THREADS", "2", 1);
    expect_env("KT_NUM_THREADS", "2x", 0);
    expect_env("KT_NUMA_FAKE_NODES", "65", 0);
    expect_env("KT_COMM_TIMEOUT_MS", "0", 0);
    expect_env("KT_COMM_TIMEOUT_MS", "99999999999", 0);
    expect_env("KT_COMM_TRANSPORT", "udp", 0);
    expect_env("KT_COMM_TRANSPORT", "tcp", 1);
    expect_env("KT_MEMORY_LIMIT", "512M", 1);
    expect_env("KT_MEMORY_LIMIT", "17179869184", 1);
    expect_env("KT_MEMORY_LIMIT", "1.5G", 0);
    expect_env("KT_MEMORY_LIMIT", "0", 0);
    expect_env("KT_MEMORY_LIMIT", "4Q", 0);
    expect_env("KT_MEMORY_LIMIT", "99999999999T", 0);
    /* a value of other bytes is shown escaped, not echoed raw */
    assert_int_equal(setenv("KT_CPU", "\xff\x1b[2J", 1), 0);
    TU_EXPECT_ERROR(kt_check_environment(), KT_EINVAL, "KT_CPU='??[2J'");
    assert_int_equal(unsetenv("KT_CPU"), 0);
}

static void test_memory_available(void **state)
{
    (void)state;
    uint64_t all = 0, capped = 0;
    assert_int_equal(kt_memory_available(&all), KT_OK);
    assert_true(all > ((uint64_t)16 << 20)); /* some memory is free on any machine that runs this */
    assert_int_equal(setenv("KT_MEMORY_LIMIT", "3M", 1), 0);
    assert_int_equal(kt_memory_available(&capped), KT_OK);
    assert_true(capped == ((uint64_t)3 << 20) || capped == all);
    assert_true(capped <= all);
    assert_int_equal(setenv("KT_MEMORY_LIMIT", "junk", 1), 0);
    TU_EXPECT_ERROR(kt_memory_available(&capped), KT_EINVAL, "KT_MEMORY_LIMIT='junk'");
    assert_int_equal(unsetenv("KT_MEMORY_LIMIT"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_codes),
        cmocka_unit_test(test_last_error),
        cmocka_unit_test(test_last_error_thread_local),
        cmocka_unit_test(test_error_context),
        cmocka_unit_test(test_try_macro),
        cmocka_unit_test(test_tensor_init),
        cmocka_unit_test(test_tensor_narrow),
        cmocka_unit_test(test_tensor_transpose),
        cmocka_unit_test(test_tensor_reshape),
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_arena_alignment),
        cmocka_unit_test(test_arena_exhaustion),
        cmocka_unit_test(test_arena_mark_reset),
        cmocka_unit_test(test_arena_init_buffer),
        cmocka_unit_test(test_arena_numa),
        cmocka_unit_test(test_version_and_machine),
        cmocka_unit_test(test_environment_strict),
        cmocka_unit_test(test_memory_available),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
