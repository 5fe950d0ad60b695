/* Op attributes as the op table describes them (lib/ops/attrs.h): every op and every
 * attribute goes .ktg -> graph -> compile -> .ktp -> load with its value intact and takes
 * part in CSE equality; defaults come from the table for C and .ktg alike; structs not made
 * by kt_op_defaults are refused; the op reference in docs/ktg.md is the table's.
 *
 * Driven by the table: a new attribute is covered with no edit here. A new op with
 * attributes needs a fixture below (inputs that its attributes can vary over); the test
 * fails naming the op until it has one. */
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
#include "lib/ops/attrs.h"
#include "tests/support/test_util.h"

/* Inputs an op's attributes can vary over, and base values for what has no default. */
typedef struct fixture {
    kt_op op;
    const char *decls; /* .ktg input declarations */
    const char *args;  /* the call's values */
    const char *base;  /* attributes every call gives (required ones, or a variant) */
} fixture;

static const fixture fixtures[] = {
    {KT_OP_MATMUL, "input a: f32[4, 4]\ninput b: f32[4, 4]\n", "a, b", ""},
    {KT_OP_SCALE, "input x: f32[4, 6]\n", "x", "alpha = 1.5"},
    {KT_OP_RMSNORM, "input x: f32[4, 6]\ninput w: f32[6]\n", "x, w", ""},
    {KT_OP_CROSS_ENTROPY, "input l: f32[4, 6]\ninput t: i32[4]\n", "l, t", ""},
    {KT_OP_TOPK_ROUTER, "input l: f32[4, 8]\n", "l", "k = 2"},
    {KT_OP_TOPK_ROUTER, "input l: f32[4, 16]\ninput b: f32[16]\n", "l, b",
     "k = 3, norm_topk = 1, scoring = sigmoid, n_group = 4, topk_group = 2, "
     "group_score = top2_sum, routed_scaling_factor = 2.5"},
    {KT_OP_CONV1D, "input x: f32[10, 4]\ninput w: f32[4, 3, 4]\n", "x, w", ""},
    {KT_OP_CONV1D, "input x: f32[10, 4]\ninput w: f32[4, 3]\n", "x, w", "depthwise = 1"},
    {KT_OP_CONCAT, "input x: f32[4, 6]\ninput y: f32[4, 6]\n", "x, y", ""},
    {KT_OP_NARROW, "input x: f32[4, 6, 8]\n", "x", "dim = 1, start = 1, length = 2"},
    {KT_OP_TRANSPOSE, "input x: f32[4, 6, 8]\n", "x", "dim0 = 0, dim1 = 1"},
    {KT_OP_RESHAPE, "input x: f32[4, 6]\n", "x", "shape = [6, 4]"},
    {KT_OP_MOE, "input x: f32[4, 6]\ninput i: i32[4, 2]\ninput w: f32[4, 2]\n", "x, i, w", ""},
    {KT_OP_HALO, "input x: f32[8, 4]\n", "x", "left = 1, right = 1"},
    /* rope: rotary_dim 0 and 4 (any other value next to them is odd), deinterleave with
     * interleaved, yarn (from linear) with original_max_positions set */
    {KT_OP_ROPE, "input x: f32[2, 4, 2, 8]\ninput p: i32[2, 4]\n", "x, p", ""},
    {KT_OP_ROPE, "input x: f32[4, 2, 8]\n", "x",
     "rotary_dim = 4, interleaved = 1, scaling = linear, original_max_positions = 64"},
    {KT_OP_CLAMP, "input x: f32[4, 6]\n", "x", "min = -1, max = 1"},
    {KT_OP_SUM, "input x: f32[4, 6, 8]\n", "x", "dim = 1"},
    {KT_OP_MEAN, "input x: f32[4, 6, 8]\n", "x", "dim = -2, keepdim = 1"},
    {KT_OP_EXPAND, "input x: f32[1, 1, 8]\n", "x", "dim = 0, size = 3"},
    {KT_OP_ATTENTION,
     "input q: f32[1, 4, 2, 8]\ninput k: f32[1, 6, 1, 8]\ninput v: f32[1, 6, 1, 4]\n"
     "input s: i32[1, 6]\n",
     "q, k, v, s", ""},
    {KT_OP_CP_ATTENTION,
     "input q: f32[1, 4, 2, 8]\ninput k: f32[1, 4, 1, 8]\ninput v: f32[1, 4, 1, 4]\n"
     "input s: i32[1, 4]\n",
     "q, k, v, s", ""},
    {KT_OP_CAST, "input x: bf16[4, 6]\n", "x", ""},
    {KT_OP_SHIFT_LABELS, "input l: i64[2, 6]\n", "l", ""},
};
enum { N_FIXTURES = sizeof fixtures / sizeof fixtures[0] };

/* "name = value" as .ktg spells the attribute's value in at. */
static void render(const kt__attr_desc *a, const kt_op_attrs *at, char *buf, size_t size)
{
    int64_t dims[KT_MAX_DIMS];
    int n, len;
    switch (a->type) {
    case KT__ATTR_FLOAT:
        snprintf(buf, size, "%s = %.9g", a->name, kt__attr_get_f(a, at));
        return;
    case KT__ATTR_ENUM:
        snprintf(buf, size, "%s = %s", a->name, a->values[kt__attr_get_i(a, at)]);
        return;
    case KT__ATTR_SHAPE:
        n = kt__attr_get_shape(a, at, dims);
        len = snprintf(buf, size, "%s = [", a->name);
        for (int k = 0; k < n; k++)
            len += snprintf(buf + len, size - (size_t)len, "%s%lld", k ? ", " : "",
                            (long long)dims[k]);
        snprintf(buf + len, size - (size_t)len, "]");
        return;
    default:
        snprintf(buf, size, "%s = %lld", a->name, (long long)kt__attr_get_i(a, at));
        return;
    }
}

/* A different valid value of attribute a (the table's range says what is valid). */
static void vary(const kt__attr_desc *a, kt_op_attrs *at)
{
    int64_t dims[KT_MAX_DIMS], rev[KT_MAX_DIMS];
    int n;
    switch (a->type) {
    case KT__ATTR_FLOAT:
        kt__attr_set_f(a, at, kt__attr_get_f(a, at) * 2 + 0.5);
        return;
    case KT__ATTR_ENUM:
        kt__attr_set_i(a, at, (kt__attr_get_i(a, at) + 1) % a->n_values);
        return;
    case KT__ATTR_SHAPE:
        n = kt__attr_get_shape(a, at, dims);
        for (int k = 0; k < n; k++)
            rev[k] = dims[n - 1 - k];
        kt__attr_set_shape(a, at, rev, n);
        return;
    default: {
        const int64_t v = kt__attr_get_i(a, at);
        kt__attr_set_i(a, at, v < a->hi ? v + 1 : v - 1);
        return;
    }
    }
}

static int same_value(const kt__attr_desc *a, const kt_op_attrs *x, const kt_op_attrs *y)
{
    int64_t dx[KT_MAX_DIMS], dy[KT_MAX_DIMS];
    switch (a->type) {
    case KT__ATTR_FLOAT:
        return kt__attr_get_f(a, x) == kt__attr_get_f(a, y);
    case KT__ATTR_SHAPE: {
        int n = kt__attr_get_shape(a, x, dx);
        if (n != kt__attr_get_shape(a, y, dy))
            return 0;
        return memcmp(dx, dy, (size_t)n * sizeof *dx) == 0;
    }
    default:
        return kt__attr_get_i(a, x) == kt__attr_get_i(a, y);
    }
}

static int fixture_attrs(const fixture *f, kt_op_attrs *out);

/* The source of a model with one call per attrs[i] on the same values. */
static void model_source(const fixture *f, const kt_op_attrs *attrs, int n_calls, char *src,
                         size_t size)
{
    int n_attrs, n_out;
    const kt__attr_desc *list = kt__attrs_of(f->op, &n_attrs);
    OK(kt_op_arity(f->op, NULL, NULL, &n_out));
    size_t len = (size_t)snprintf(src, size, "%s", f->decls);
    for (int c = 0; c < n_calls; c++) {
        if (n_out == 2)
            len += (size_t)snprintf(src + len, size - len, "o%d, p%d = ", c, c);
        else
            len += (size_t)snprintf(src + len, size - len, "o%d = ", c);
        len += (size_t)snprintf(src + len, size - len, "%s(%s", kt_op_name(f->op), f->args);
        for (int i = 0; i < n_attrs; i++) {
            char one[160];
            render(&list[i], &attrs[c], one, sizeof one);
            len += (size_t)snprintf(src + len, size - len, ", %s", one);
        }
        len += (size_t)snprintf(src + len, size - len, ")\noutput o%d\n", c);
        if (n_out == 2)
            len += (size_t)snprintf(src + len, size - len, "output p%d\n", c);
    }
}

/* The attributes of a call with the fixture's base text, as the .ktg parser makes them. */
static int fixture_attrs(const fixture *f, kt_op_attrs *out)
{
    char src[1024];
    int n_out;
    OK(kt_op_arity(f->op, NULL, NULL, &n_out));
    snprintf(src, sizeof src, "%s%s = %s(%s%s%s)\noutput o\n%s", f->decls,
             n_out == 2 ? "o, p" : "o", kt_op_name(f->op), f->args, f->base[0] ? ", " : "",
             f->base, n_out == 2 ? "output p\n" : "");
    kt_graph *g = NULL;
    char diag[2048];
    int n_err = 0;
    if (kt_ktg_parse(src, strlen(src), "fixture.ktg", NULL, 0, &g, diag, sizeof diag,
                     &n_err) != KT_OK)
        fail_msg("fixture of %s does not parse:\n%s", kt_op_name(f->op), diag);
    kt_program *p = NULL;
    OK(kt_compile(g, NULL, &p));
    int found = 0;
    for (int32_t s = 0; s < p->n_steps; s++)
        if (p->steps[s].kind == KT__STEP_FORWARD && p->steps[s].op == f->op) {
            *out = p->steps[s].attrs;
            found = 1;
        }
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return found;
}

/* Parses, compiles, saves and loads the model with calls attrs[0..n); returns how many
 * steps of the op the loaded program has (written to got[]), or -1 if it does not build. */
static int through_ktp(const fixture *f, const kt_op_attrs *attrs, int n, kt_op_attrs *got)
{
    char src[4096];
    model_source(f, attrs, n, src, sizeof src);
    kt_graph *g = NULL;
    char diag[4096];
    int n_err = 0;
    if (kt_ktg_parse(src, strlen(src), "m.ktg", NULL, 0, &g, diag, sizeof diag, &n_err) !=
        KT_OK)
        return -1;
    kt_program *p = NULL, *q = NULL;
    OK(kt_compile(g, NULL, &p));
    size_t bytes = 0;
    OK(kt_program_serialized_size(p, &bytes));
    void *buf = malloc(bytes);
    OK(kt_program_serialize(p, buf, bytes));
    OK(kt_program_load_memory(buf, bytes, &q));
    int count = 0;
    for (int32_t s = 0; s < q->n_steps; s++)
        if (q->steps[s].kind == KT__STEP_FORWARD && q->steps[s].op == f->op)
            got[count++] = q->steps[s].attrs;
    free(buf);
    kt_program_destroy(q);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return count;
}

static void test_every_attribute(void **state)
{
    (void)state;
    int covered_ops = 0;
    for (int op = 0; op < KT_OP_COUNT; op++) {
        int n_attrs;
        const kt__attr_desc *list = kt__attrs_of((kt_op)op, &n_attrs);
        if (n_attrs == 0)
            continue;
        int have_fixture = 0;
        for (int i = 0; i < n_attrs; i++) {
            const kt__attr_desc *a = &list[i];
            /* values of it that made the trip: at least two different ones must */
            kt_op_attrs first_seen;
            int n_seen = 0, two_values = 0, kept_apart = 0;
            for (int fi = 0; fi < N_FIXTURES; fi++) {
                const fixture *f = &fixtures[fi];
                if (f->op != (kt_op)op)
                    continue;
                have_fixture = 1;
                kt_op_attrs base, pair[2], got[4];
                assert_true(fixture_attrs(f, &base));
                /* each value alone survives the trip */
                pair[0] = base;
                pair[1] = base;
                vary(a, &pair[1]);
                assert_false(same_value(a, &pair[0], &pair[1]));
                for (int v = 0; v < 2; v++) {
                    if (through_ktp(f, &pair[v], 1, got) != 1)
                        continue;
                    for (int k = 0; k < n_attrs; k++)
                        if (!same_value(&list[k], &got[0], &pair[v]))
                            fail_msg("%s.%s: %s changed on the way through .ktp",
                                     kt_op_name((kt_op)op), a->name, list[k].name);
                    if (n_seen++ == 0)
                        first_seen = pair[v];
                    else if (!same_value(a, &first_seen, &pair[v]))
                        two_values = 1;
                }
                /* two calls differing only in it stay two steps; two equal ones merge */
                int n = through_ktp(f, pair, 2, got);
                if (n < 0)
                    continue;
                if (n != 2)
                    fail_msg("%s.%s: two nodes differing only in it became %d step(s)",
                             kt_op_name((kt_op)op), a->name, n);
                kt_op_attrs same[2] = {base, base};
                assert_int_equal(through_ktp(f, same, 2, got), 1);
                kept_apart = 1;
            }
            /* where no inputs suit both values (conv1d's depthwise changes w's rank), CSE
             * equality is checked on the structs CSE compares (prune.c calls it) */
            if (!kept_apart) {
                const fixture *f = NULL;
                for (int fi = 0; fi < N_FIXTURES && f == NULL; fi++)
                    if (fixtures[fi].op == (kt_op)op)
                        f = &fixtures[fi];
                if (f == NULL)
                    fail_msg("op %s has attributes but no fixture in test_op_attrs.c",
                             kt_op_name((kt_op)op));
                kt_op_attrs x, y;
                assert_true(fixture_attrs(f, &x));
                y = x;
                vary(a, &y);
                if (kt__attrs_equal((kt_op)op, &x, &y))
                    fail_msg("%s.%s does not take part in CSE equality",
                             kt_op_name((kt_op)op), a->name);
            }
            if (!have_fixture)
                fail_msg("op %s has attributes but no fixture in test_op_attrs.c",
                         kt_op_name((kt_op)op));
            if (!two_values)
                fail_msg("%s.%s: the fixtures build no two different values of it",
                         kt_op_name((kt_op)op), a->name);
        }
        covered_ops++;
    }
    assert_true(covered_ops >= 10);
}

/* C and .ktg share the table's defaults: a call giving only the required attributes has
 * every other attribute at kt_op_defaults' value, which is the table's. */
static void test_defaults(void **state)
{
    (void)state;
    assert_true(kt_op_defaults(KT_OP_CROSS_ENTROPY).ignore_index == -100);
    assert_true(kt_op_defaults(KT_OP_RMSNORM).eps == 1e-6f);
    for (int fi = 0; fi < N_FIXTURES; fi++) {
        const fixture *f = &fixtures[fi];
        kt_op_attrs parsed, c = kt_op_defaults(f->op);
        assert_true(fixture_attrs(f, &parsed));
        assert_int_equal(parsed.made_for, c.made_for);
        int n;
        const kt__attr_desc *list = kt__attrs_of(f->op, &n);
        for (int i = 0; i < n; i++) {
            char given[64];
            snprintf(given, sizeof given, "%s =", list[i].name);
            if (list[i].required || strstr(f->base, given) != NULL)
                continue;
            if (!same_value(&list[i], &parsed, &c))
                fail_msg("%s.%s: .ktg and kt_op_defaults disagree", kt_op_name(f->op),
                         list[i].name);
            if (list[i].type == KT__ATTR_FLOAT)
                assert_true(kt__attr_get_f(&list[i], &c) == (double)(float)list[i].def_f);
            else if (list[i].type != KT__ATTR_SHAPE)
                assert_true(kt__attr_get_i(&list[i], &c) == list[i].def_i);
        }
    }
}

/* The new user's program: cross_entropy through C on targets of class 0. */
static void test_cross_entropy_class_zero(void **state)
{
    (void)state;
    kt_tensor in[2] = {tu_new(KT_F32, 2, 3), tu_new(KT_I32, 2)}, loss = tu_alloc(KT_F32, 0, NULL);
    for (int i = 0; i < 6; i++)
        tu_set(&in[0], i, 0.5 * i);
    tu_set(&in[1], 0, 0), tu_set(&in[1], 1, 0);
    const kt_op_attrs d = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    OK(kt_op_forward(KT_OP_CROSS_ENTROPY, &d, in, 2, &loss, 1, NULL));
    const double with_defaults = tu_get(&loss, 0);
    OK(kt_op_forward(KT_OP_CROSS_ENTROPY, NULL, in, 2, &loss, 1, NULL));
    assert_true(tu_get(&loss, 0) == with_defaults);
    assert_true(with_defaults > 1.0); /* -log_softmax of the smallest logit: not 0 */
    /* a zeroed or designated-initialised struct is refused, saying how to make one */
    kt_op_attrs zero;
    memset(&zero, 0, sizeof zero);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &zero, in, 2, &loss, 1, NULL),
                    KT_EINVAL, "cross_entropy", "not made by kt_op_defaults",
                    "kt_op_defaults(KT_OP_CROSS_ENTROPY)");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &(kt_op_attrs){.ignore_index = -100},
                                  in, 2, &loss, 1, NULL),
                    KT_EINVAL, "not made by kt_op_defaults");
    const kt_op_attrs mm = kt_op_defaults(KT_OP_MATMUL);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CROSS_ENTROPY, &mm, in, 2, &loss, 1), KT_EINVAL,
                    "made for 'matmul'", "kt_op_defaults(KT_OP_CROSS_ENTROPY)");
    /* an op without attributes reads none: anything goes */
    kt_tensor sq = tu_new(KT_F32, 2, 3);
    OK(kt_op_forward(KT_OP_SILU, &zero, in, 1, &sq, 1, NULL));
    /* a required attribute is named, through C and through the builder */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SCALE, NULL, in, 1, &sq, 1, NULL), KT_EINVAL,
                    "scale: attribute alpha is required");
    kt_graph *g = NULL;
    kt_value x, y;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){2, 3}, &x));
    TU_EXPECT_ERROR(kt_graph_op(g, "s", KT_OP_SCALE, NULL, &x, 1, &y), KT_EINVAL,
                    "node 0 (scale 's')", "alpha is required");
    TU_EXPECT_ERROR(kt_graph_op(g, "t", KT_OP_TRANSPOSE, &zero, &x, 1, &y), KT_EINVAL,
                    "transpose", "kt_op_defaults(KT_OP_TRANSPOSE)");
    kt_op_attrs sc = kt_op_defaults(KT_OP_SCALE);
    sc.alpha = 2.0f;
    OK(kt_graph_op(g, "s", KT_OP_SCALE, &sc, &x, 1, &y));
    sc.alpha = INFINITY;
    TU_EXPECT_ERROR(kt_graph_op(g, "s2", KT_OP_SCALE, &sc, &x, 1, &y), KT_EINVAL,
                    "scale: attribute alpha = inf");
    kt_graph_destroy(g);
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&loss), tu_free(&sq);
}

/* docs/ktg.md's op reference is the table's, between its markers. */
#define DOC_BEGIN "<!-- op-attributes: begin"
#define DOC_END "<!-- op-attributes: end -->"

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void test_docs_table(void **state)
{
    (void)state;
    char *doc = read_text(KT_SOURCE_DIR "/docs/ktg.md");
    char *begin = strstr(doc, DOC_BEGIN), *end = begin ? strstr(begin, DOC_END) : NULL;
    if (begin == NULL || end == NULL)
        fail_msg("docs/ktg.md has no '%s ... %s' section", DOC_BEGIN, DOC_END);
    begin = strchr(begin, '\n') + 1;
    size_t need = kt__attrs_reference(NULL, 0);
    char *table = malloc(need + 1);
    kt__attrs_reference(table, need + 1);
    if ((size_t)(end - begin) != need || memcmp(begin, table, need) != 0)
        fail_msg("docs/ktg.md's op reference differs from the op table; regenerate it with\n"
                 "  build/tests/test_op_attrs --print-reference\n"
                 "and paste it between the markers. The table says:\n%s", table);
    free(table);
    free(doc);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--print-reference") == 0) {
        size_t need = kt__attrs_reference(NULL, 0);
        char *table = malloc(need + 1);
        kt__attrs_reference(table, need + 1);
        fputs(table, stdout);
        free(table);
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_attribute),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_cross_entropy_class_zero),
        cmocka_unit_test(test_docs_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
