/* Test helpers (see test_util.h). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

#include "lib/ops/attrs.h"

void tu_rng_seed(tu_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 1; }

uint64_t tu_rng_next(tu_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1Dull;
}

double tu_rng_uniform(tu_rng *r, double lo, double hi)
{
    double u = (double)(tu_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return lo + (hi - lo) * u;
}

double tu_rng_normal(tu_rng *r)
{
    double u1 = tu_rng_uniform(r, 1e-12, 1.0), u2 = tu_rng_uniform(r, 0.0, 1.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

kt_tensor tu_alloc(kt_dtype dtype, int ndim, const int64_t *shape)
{
    kt_tensor t;
    assert_int_equal(kt_tensor_init(&t, NULL, dtype, ndim, shape), KT_OK);
    size_t bytes = kt_tensor_nbytes(&t);
    t.data = calloc(1, bytes ? bytes : 1);
    assert_non_null(t.data);
    return t;
}

void tu_free(kt_tensor *t)
{
    free(t->data);
    t->data = NULL;
}

double tu_get(const kt_tensor *t, int64_t i)
{
    switch (t->dtype) {
    case KT_F32:
        return ((const float *)t->data)[i];
    case KT_BF16:
        return kt_bf16_to_f32_1(((const uint16_t *)t->data)[i]);
    case KT_F16:
        return kt_f16_to_f32_1(((const uint16_t *)t->data)[i]);
    case KT_I32:
        return ((const int32_t *)t->data)[i];
    case KT_I64:
        return (double)((const int64_t *)t->data)[i];
    default:
        fail_msg("bad dtype");
        return 0;
    }
}

void tu_set(kt_tensor *t, int64_t i, double v)
{
    switch (t->dtype) {
    case KT_F32:
        ((float *)t->data)[i] = (float)v;
        break;
    case KT_BF16:
        ((uint16_t *)t->data)[i] = kt_f32_to_bf16_1((float)v);
        break;
    case KT_F16:
        ((uint16_t *)t->data)[i] = kt_f32_to_f16_1((float)v);
        break;
    case KT_I32:
        ((int32_t *)t->data)[i] = (int32_t)v;
        break;
    case KT_I64:
        ((int64_t *)t->data)[i] = (int64_t)v;
        break;
    default:
        fail_msg("bad dtype");
    }
}

void tu_fill_uniform(kt_tensor *t, tu_rng *r, double lo, double hi)
{
    int64_t n = kt_tensor_numel(t);
    int integer = t->dtype == KT_I32 || t->dtype == KT_I64;
    for (int64_t i = 0; i < n; i++) {
        double v = tu_rng_uniform(r, lo, hi);
        tu_set(t, i, integer ? floor(v) : v);
    }
}

kt_tensor tu_clone(const kt_tensor *t)
{
    kt_tensor c = tu_alloc(t->dtype, t->ndim, t->shape);
    memcpy(c.data, t->data, kt_tensor_nbytes(t));
    return c;
}

kt_tensor tu_convert(const kt_tensor *t, kt_dtype dtype)
{
    kt_tensor c = tu_alloc(dtype, t->ndim, t->shape);
    int64_t n = kt_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        tu_set(&c, i, tu_get(t, i));
    return c;
}

double tu_rel_err(const kt_tensor *a, const kt_tensor *b, double floor)
{
    int64_t n = kt_tensor_numel(b);
    assert_int_equal(kt_tensor_numel(a), n);
    double scale = floor, err = 0.0;
    for (int64_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(tu_get(b, i)));
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(tu_get(a, i) - tu_get(b, i));
        if (isnan(d))
            return INFINITY;
        err = fmax(err, d);
    }
    return err / scale;
}

int tu_bitwise_equal(const kt_tensor *a, const kt_tensor *b)
{
    return a->dtype == b->dtype && kt_tensor_same_shape(a, b) &&
           memcmp(a->data, b->data, kt_tensor_nbytes(a)) == 0;
}

void tu_expect_error(kt_status got, kt_status expected, const char *first, ...)
{
    if (got != expected)
        fail_msg("expected status %d (%s), got %d (%s); message: %s", expected,
                 kt_status_str(expected), got, kt_status_str(got), kt_last_error());
    va_list ap;
    va_start(ap, first);
    for (const char *s = first; s != NULL; s = va_arg(ap, const char *))
        if (strstr(kt_last_error(), s) == NULL)
            fail_msg("error message '%s' does not mention '%s'", kt_last_error(), s);
    va_end(ap);
}

kt_value tu_op1(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs, kt_value a)
{
    kt_value out;
    if (kt_graph_op(g, name, op, attrs, &a, 1, &out) != KT_OK)
        fail_msg("kt_graph_op(%s): %s", kt_op_name(op), kt_last_error());
    return out;
}

kt_value tu_op2(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs, kt_value a,
                kt_value b)
{
    kt_value in[2] = {a, b}, out;
    if (kt_graph_op(g, name, op, attrs, in, 2, &out) != KT_OK)
        fail_msg("kt_graph_op(%s): %s", kt_op_name(op), kt_last_error());
    return out;
}

kt_op_attrs *tu_attrs_into(kt_op_attrs *dst, kt_op op, kt_op_attrs given)
{
    *dst = kt_op_defaults(op);
    if (given.made_for == dst->made_for) {
        *dst = given;
        return dst;
    }
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *a = &list[i];
        memcpy((char *)dst + a->offset, (const char *)&given + a->offset,
               a->type == KT__ATTR_SHAPE   ? KT_MAX_DIMS * sizeof(int64_t)
               : a->type == KT__ATTR_INT64 ? sizeof(int64_t)
                                           : sizeof(int));
        if (a->type == KT__ATTR_SHAPE)
            memcpy((char *)dst + a->count_offset, (const char *)&given + a->count_offset,
                   sizeof(int));
        /* a zero the attribute cannot take is one the initialiser did not name (an attribute
         * added after the test was written, like topk_router's n_group): its default */
        const int zero = a->type == KT__ATTR_FLOAT ? kt__attr_get_f(a, &given) == 0.0
                         : a->type == KT__ATTR_SHAPE ? 0
                                                     : kt__attr_get_i(a, &given) == 0;
        if (zero && !a->required &&
            (a->type == KT__ATTR_FLOAT ? !kt__attr_in_range_f(a, 0.0)
                                       : !kt__attr_in_range_i(a, 0))) {
            const kt_op_attrs def = kt_op_defaults(op);
            memcpy((char *)dst + a->offset, (const char *)&def + a->offset,
                   a->type == KT__ATTR_INT64 ? sizeof(int64_t) : sizeof(int));
        }
    }
    return dst;
}

kt_program *tu_compile_ktg(const char *text, const char *filename, int training)
{
    char diag[4096];
    kt_graph *g = NULL;
    if (kt_ktg_parse(text, strlen(text), filename, NULL, 0, &g, diag, sizeof diag, NULL) !=
        KT_OK)
        fail_msg("%s does not parse:\n%s", filename, diag);
    kt_compile_options co = {.training = training};
    kt_program *p = NULL;
    kt_status st = kt_compile(g, &co, &p);
    kt_graph_destroy(g);
    if (st != KT_OK)
        fail_msg("%s does not compile: %s", filename, kt_last_error());
    return p;
}

char *tu_temp_dir(const char *tag)
{
    char tmpl[256];
    snprintf(tmpl, sizeof tmpl, "/tmp/%s.XXXXXX", tag);
    char *dir = mkdtemp(tmpl);
    assert_non_null(dir);
    char *copy = strdup(dir);
    assert_non_null(copy);
    return copy;
}

void tu_remove_tree(const char *dir)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}
