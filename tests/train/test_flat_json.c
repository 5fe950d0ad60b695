/* kt-train's run.json reader (tools/kt-train/flat_json.c): what kt-train writes reads back by
 * path; anything else is refused with the byte offset. Inputs are copied into buffers of their
 * exact length (no NUL after them), so a read past the end is an AddressSanitizer error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tools/kt-train/flat_json.h"

static flat_json j;
static char err[256];

static int parse(const char *text)
{
    size_t n = strlen(text);
    char *exact = malloc(n > 0 ? n : 1);
    assert_non_null(exact);
    memcpy(exact, text, n);
    err[0] = '\0';
    int rc = flat_json_parse(exact, n, &j, err, sizeof err);
    free(exact);
    return rc;
}

static void expect_refused(const char *text, const char *why)
{
    assert_int_equal(parse(text), -1);
    if (strstr(err, why) == NULL || strstr(err, "at byte") == NULL)
        fail_msg("'%s': '%s' does not say '%s' and where", text, err, why);
}

static void test_reads_what_kt_train_writes(void **state)
{
    (void)state;
    assert_int_equal(parse("{\n  \"format\": \"kt-train-run-1\",\n  \"step\": 14,\n"
                           "  \"data_position\": {\"windows\": 28, \"tokens\": -896},\n"
                           "  \"settings\": {\"lr\": \"0.00999999978\", "
                           "\"data\": \"a \\\"b\\\" \\\\ \\/ \\u0041\\u007f\"}\n}\n"),
                     0);
    assert_int_equal(j.n, 6);
    assert_string_equal(flat_json_get(&j, "format")->value, "kt-train-run-1");
    assert_int_equal(flat_json_get(&j, "step")->is_string, 0);
    assert_string_equal(flat_json_get(&j, "step")->value, "14");
    assert_string_equal(flat_json_get(&j, "data_position.tokens")->value, "-896");
    assert_string_equal(flat_json_get(&j, "settings.data")->value, "a \"b\" \\ / A\x7f");
    assert_null(flat_json_get(&j, "settings"));
    assert_null(flat_json_get(&j, "absent"));
}

static void test_refuses_what_it_does_not_write(void **state)
{
    (void)state;
    expect_refused("{\"a\": \"\\u1e", "an escape kt-train does not write"); /* cut short */
    expect_refused("{\"a\": \"\\u 01f\"}", "an escape kt-train does not write");
    expect_refused("{\"a\": \"\\u+01f\"}", "an escape kt-train does not write");
    expect_refused("{\"a\": \"\\u0000\"}", "an escape kt-train does not write");
    expect_refused("{\"a\": \"\\u00e9\"}", "an escape kt-train does not write");
    expect_refused("{\"a\": \"\\n\"}", "an escape kt-train does not write");
    expect_refused("{\"a\": -}", "expected a string, an integer or an object");
    expect_refused("{\"a\": 1.5}", "");
    expect_refused("{\"a\": [1]}", "expected a string, an integer or an object");
    expect_refused("{\"a\": \"x", "an unterminated string");
    expect_refused("{\"a\": 1} x", "");
    expect_refused("{\"a\":{\"b\":{\"c\":{\"d\":{\"e\":{\"f\":1}}}}}}", "nested too deep");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reads_what_kt_train_writes),
        cmocka_unit_test(test_refuses_what_it_does_not_write),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
