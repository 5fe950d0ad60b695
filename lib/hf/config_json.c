/* Typed look-ups in config.json, each error naming the file and the key. */
#include "lib/hf/config_json.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"

const kt__json_value *kt__hf_member(const kt__hf_json *j, const char *key)
{
    const kt__json_value *found = kt__json_member(j->obj, key);
    return found != NULL && found->type == KT__JSON_NULL ? NULL : found;
}

/* The value as it reads in the file, for messages. */
static void describe(const kt__json_value *v, char *out, size_t size)
{
    switch (v->type) {
    case KT__JSON_NULL:
        snprintf(out, size, "null");
        break;
    case KT__JSON_BOOL:
        snprintf(out, size, "%s", v->u.boolean ? "true" : "false");
        break;
    case KT__JSON_INT:
        snprintf(out, size, "%s%llu", v->u.integer.negative ? "-" : "",
                 (unsigned long long)v->u.integer.magnitude);
        break;
    case KT__JSON_FLOAT:
        snprintf(out, size, "%.17g", v->u.number);
        break;
    case KT__JSON_STRING:
        snprintf(out, size, "\"%.*s\"", (int)(v->u.string.len < 64 ? v->u.string.len : 64),
                 v->u.string.s);
        break;
    default:
        snprintf(out, size, "an %s", kt__json_type_name(v->type));
    }
}

static kt_status missing(const kt__hf_json *j, const char *key)
{
    return kt__error(KT_EFORMAT, "%s: the key '%s%s' is missing (or null)", j->path, j->where,
                     key);
}

static kt_status bad(const kt__hf_json *j, const char *key, const kt__json_value *v,
                     const char *expected)
{
    char got[96];
    describe(v, got, sizeof got);
    return kt__error(KT_EFORMAT, "%s: '%s%s' = %s, expected %s", j->path, j->where, key, got,
                     expected);
}

kt_status kt__hf_unsupported(const kt__hf_json *j, const char *key, const char *why)
{
    const kt__json_value *v = kt__hf_member(j, key);
    char got[96] = "null";
    if (v != NULL)
        describe(v, got, sizeof got);
    return kt__error(KT_EUNSUPPORTED, "%s: '%s%s' = %s: %s", j->path, j->where, key, got, why);
}

kt_status kt__hf_int(const kt__hf_json *j, const char *key, int required, int64_t lo,
                     int64_t hi, int64_t *out)
{
    const kt__json_value *v = kt__hf_member(j, key);
    if (v == NULL)
        return required ? missing(j, key) : KT_OK;
    char expected[96];
    snprintf(expected, sizeof expected, "an integer from %lld to %lld", (long long)lo,
             (long long)hi);
    if (v->type != KT__JSON_INT || v->u.integer.magnitude > (uint64_t)INT64_MAX)
        return bad(j, key, v, expected);
    int64_t x = (int64_t)v->u.integer.magnitude;
    if (v->u.integer.negative)
        x = -x;
    if (x < lo || x > hi)
        return bad(j, key, v, expected);
    *out = x;
    return KT_OK;
}

kt_status kt__hf_num(const kt__hf_json *j, const char *key, int required, double lo,
                     double hi, double *out)
{
    const kt__json_value *v = kt__hf_member(j, key);
    if (v == NULL)
        return required ? missing(j, key) : KT_OK;
    double x;
    if (v->type == KT__JSON_FLOAT)
        x = v->u.number;
    else if (v->type == KT__JSON_INT)
        x = v->u.integer.negative ? -(double)v->u.integer.magnitude
                                  : (double)v->u.integer.magnitude;
    else
        return bad(j, key, v, "a number");
    char expected[96];
    snprintf(expected, sizeof expected, "a number from %g to %g", lo, hi);
    if (!isfinite(x) || x < lo || x > hi)
        return bad(j, key, v, expected);
    *out = x;
    return KT_OK;
}

kt_status kt__hf_bool(const kt__hf_json *j, const char *key, int *out)
{
    const kt__json_value *v = kt__hf_member(j, key);
    if (v == NULL)
        return KT_OK;
    if (v->type != KT__JSON_BOOL)
        return bad(j, key, v, "true or false");
    *out = v->u.boolean;
    return KT_OK;
}

kt_status kt__hf_str(const kt__hf_json *j, const char *key, const char **out)
{
    const kt__json_value *v = kt__hf_member(j, key);
    *out = NULL;
    if (v == NULL)
        return KT_OK;
    if (v->type != KT__JSON_STRING || strlen(v->u.string.s) != v->u.string.len)
        return bad(j, key, v, "a string");
    *out = v->u.string.s;
    return KT_OK;
}
