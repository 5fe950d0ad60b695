/* The attribute mechanism: defaults, validation and equality, driven by each op's list in
 * its table row (attrs.h). Nothing here names an op or a field. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/ops/attrs.h"
#include "lib/ops/op_desc.h"

static const char *const upper_names[KT_OP_COUNT] = {
#define KT__OP_UPPER(upper, lower) #upper,
    KT_OP_LIST(KT__OP_UPPER)
#undef KT__OP_UPPER
};

const kt__attr_desc *kt__attrs_of(kt_op op, int *n_out)
{
    const kt__op_desc *d = kt__op_get(op);
    *n_out = d ? d->n_attrs : 0;
    return d ? d->attrs : NULL;
}

const kt__attr_desc *kt__attr_find(kt_op op, const char *name, size_t len)
{
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    for (int i = 0; i < n; i++)
        if (strlen(list[i].name) == len && memcmp(list[i].name, name, len) == 0)
            return &list[i];
    return NULL;
}

/* ---- field access ---------------------------------------------------------------------------- */

int64_t kt__attr_get_i(const kt__attr_desc *a, const kt_op_attrs *at)
{
    const char *f = (const char *)at + a->offset;
    if (a->type == KT__ATTR_INT64) {
        int64_t v;
        memcpy(&v, f, sizeof v);
        return v;
    }
    int v; /* bool, int and enum fields (an enum's storage is an int here: its values fit) */
    memcpy(&v, f, sizeof v);
    return v;
}

void kt__attr_set_i(const kt__attr_desc *a, kt_op_attrs *at, int64_t v)
{
    char *f = (char *)at + a->offset;
    if (a->type == KT__ATTR_INT64) {
        memcpy(f, &v, sizeof v);
        return;
    }
    int i = v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : (int)v;
    memcpy(f, &i, sizeof i);
}

double kt__attr_get_f(const kt__attr_desc *a, const kt_op_attrs *at)
{
    float v;
    memcpy(&v, (const char *)at + a->offset, sizeof v);
    return v;
}

void kt__attr_set_f(const kt__attr_desc *a, kt_op_attrs *at, double v)
{
    float f = (float)v;
    memcpy((char *)at + a->offset, &f, sizeof f);
}

int kt__attr_get_shape(const kt__attr_desc *a, const kt_op_attrs *at, int64_t *dims)
{
    int n;
    memcpy(&n, (const char *)at + a->count_offset, sizeof n);
    memcpy(dims, (const char *)at + a->offset, KT_MAX_DIMS * sizeof *dims);
    return n;
}

void kt__attr_set_shape(const kt__attr_desc *a, kt_op_attrs *at, const int64_t *dims, int n)
{
    int64_t full[KT_MAX_DIMS] = {0};
    for (int d = 0; d < n && d < KT_MAX_DIMS; d++)
        full[d] = dims[d];
    memcpy((char *)at + a->offset, full, sizeof full);
    memcpy((char *)at + a->count_offset, &n, sizeof n);
}

/* ---- ranges ---------------------------------------------------------------------------------- */

int kt__attr_in_range_i(const kt__attr_desc *a, int64_t v) { return v >= a->lo && v <= a->hi; }

int kt__attr_in_range_f(const kt__attr_desc *a, double v)
{
    return isfinite(v) && v >= a->flo && v <= a->fhi;
}

void kt__attr_range_text(const kt__attr_desc *a, char *buf, size_t size)
{
    switch (a->type) {
    case KT__ATTR_BOOL:
        snprintf(buf, size, "0 or 1");
        return;
    case KT__ATTR_FLOAT:
        if (a->flo <= -FLT_MAX && a->fhi >= FLT_MAX)
            snprintf(buf, size, "a finite float");
        else if (a->fhi >= FLT_MAX)
            snprintf(buf, size, "a finite float >= %g", a->flo);
        else
            snprintf(buf, size, "a float in %g..%g", a->flo, a->fhi);
        return;
    case KT__ATTR_ENUM: {
        size_t len = 0;
        buf[0] = '\0';
        for (int i = 0; i < a->n_values && len < size; i++) {
            const char *sep = i == 0 ? "" : i == a->n_values - 1 ? " or " : ", ";
            int w = snprintf(buf + len, size - len, "%s%s", sep, a->values[i]);
            if (w > 0)
                len += (size_t)w;
        }
        return;
    }
    case KT__ATTR_SHAPE:
        snprintf(buf, size, "[up to %d integers >= %lld]", KT_MAX_DIMS, (long long)a->lo);
        return;
    default:
        if (a->lo == INT64_MIN && a->hi == INT64_MAX)
            snprintf(buf, size, "any integer");
        else if (a->hi == INT64_MAX)
            snprintf(buf, size, "an integer >= %lld", (long long)a->lo);
        else
            snprintf(buf, size, "a value in %lld..%lld", (long long)a->lo, (long long)a->hi);
        return;
    }
}

void kt__attr_names_text(kt_op op, char *buf, size_t size)
{
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len < size; i++) {
        const char *sep = i == 0 ? "" : i == n - 1 ? " or " : ", ";
        int w = snprintf(buf + len, size - len, "%s%s", sep, list[i].name);
        if (w > 0)
            len += (size_t)w;
    }
}

int kt__attr_is_unset(const kt__attr_desc *a, const kt_op_attrs *at)
{
    int64_t dims[KT_MAX_DIMS];
    switch (a->type) {
    case KT__ATTR_FLOAT:
        return isnan(kt__attr_get_f(a, at));
    case KT__ATTR_SHAPE:
        return kt__attr_get_shape(a, at, dims) < 0;
    case KT__ATTR_INT64:
        return kt__attr_get_i(a, at) == INT64_MIN;
    default:
        return kt__attr_get_i(a, at) == INT32_MIN;
    }
}

/* ---- the public defaults and their checks ---------------------------------------------------- */

kt_op_attrs kt_op_defaults(kt_op op)
{
    kt_op_attrs at;
    memset(&at, 0, sizeof at); /* also the padding, so equal structs compare equal bytewise */
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *a = &list[i];
        if (a->type == KT__ATTR_SHAPE) {
            kt__attr_set_shape(a, &at, NULL, a->required ? -1 : 0);
        } else if (a->type == KT__ATTR_FLOAT) {
            kt__attr_set_f(a, &at, a->required ? (double)NAN : a->def_f);
        } else if (a->required) {
            kt__attr_set_i(a, &at, a->type == KT__ATTR_INT64 ? INT64_MIN : INT32_MIN);
        } else {
            kt__attr_set_i(a, &at, a->def_i);
        }
    }
    if (kt__op_get(op) != NULL)
        at.made_for = KT__ATTRS_STAMP(op);
    return at;
}

kt_status kt__attrs_resolve(kt_op op, const kt_op_attrs *attrs, kt_op_attrs *out)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return kt__error(KT_EINVAL, "invalid op %d", (int)op);
    if (attrs == NULL || d->n_attrs == 0) {
        *out = kt_op_defaults(op); /* an op without attributes reads none of the struct */
    } else if (attrs->made_for != KT__ATTRS_STAMP(op)) {
        const char *up = upper_names[op];
        if (attrs->made_for > KT__ATTRS_STAMP(0) - 1 &&
            attrs->made_for <= KT__ATTRS_STAMP(KT_OP_COUNT - 1)) {
            const unsigned other = attrs->made_for - KT__ATTRS_STAMP(0);
            return kt__error(KT_EINVAL, "%s: the attributes were made for '%s' "
                             "(kt_op_defaults(KT_OP_%s)), expected "
                             "kt_op_defaults(KT_OP_%s) or NULL for all defaults",
                             d->name, kt_op_name((kt_op)other), upper_names[other], up);
        }
        return kt__error(KT_EINVAL, "%s: the attributes were not made by kt_op_defaults (a "
                         "zeroed or designated-initialised kt_op_attrs has no defaults), "
                         "expected kt_op_attrs a = kt_op_defaults(KT_OP_%s), then set the "
                         "fields to change, or NULL for all defaults", d->name, up);
    } else {
        *out = *attrs;
    }
    for (int i = 0; i < d->n_attrs; i++)
        if (d->attrs[i].required && kt__attr_is_unset(&d->attrs[i], out))
            return kt__error(KT_EINVAL, "%s: attribute %s is required (it has no default), "
                             "expected it set after kt_op_defaults(KT_OP_%s)",
                             d->name, d->attrs[i].name, upper_names[op]);
    return KT_OK;
}

/* The message of a value outside its range; `what` is the value as the message shows it
 * (" = 3", " entry 1 = -2"). The range text is built only here, on failure. */
static kt_status out_of_range(kt_op op, const kt__attr_desc *a, const char *what)
{
    char range[160];
    kt__attr_range_text(a, range, sizeof range);
    return kt__error(KT_EINVAL, "%s: attribute %s%s, expected %s", kt_op_name(op), a->name, what,
                     range);
}

kt_status kt__attrs_check_ranges(kt_op op, const kt_op_attrs *attrs)
{
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    char what[96];
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *a = &list[i];
        if (a->type == KT__ATTR_FLOAT) {
            double v = kt__attr_get_f(a, attrs);
            if (!kt__attr_in_range_f(a, v)) {
                snprintf(what, sizeof what, " = %g", v);
                return out_of_range(op, a, what);
            }
        } else if (a->type == KT__ATTR_SHAPE) {
            int64_t dims[KT_MAX_DIMS];
            int nd = kt__attr_get_shape(a, attrs, dims);
            if (nd < 0 || nd > KT_MAX_DIMS) {
                snprintf(what, sizeof what, " has %d entries", nd);
                return out_of_range(op, a, what);
            }
            for (int k = 0; k < nd; k++)
                if (!kt__attr_in_range_i(a, dims[k])) {
                    snprintf(what, sizeof what, " entry %d = %lld", k, (long long)dims[k]);
                    return out_of_range(op, a, what);
                }
        } else {
            int64_t v = kt__attr_get_i(a, attrs);
            if (!kt__attr_in_range_i(a, v)) {
                snprintf(what, sizeof what, " = %lld", (long long)v);
                return out_of_range(op, a, what);
            }
        }
    }
    return KT_OK;
}

int kt__attrs_equal(kt_op op, const kt_op_attrs *a, const kt_op_attrs *b)
{
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *d = &list[i];
        if (d->type == KT__ATTR_FLOAT) {
            /* bitwise: -0 and 0 scale differently signed zeros; NaN never reaches here */
            float x = (float)kt__attr_get_f(d, a), y = (float)kt__attr_get_f(d, b);
            if (memcmp(&x, &y, sizeof x) != 0)
                return 0;
        } else if (d->type == KT__ATTR_SHAPE) {
            int64_t da[KT_MAX_DIMS], db[KT_MAX_DIMS];
            int na = kt__attr_get_shape(d, a, da), nb = kt__attr_get_shape(d, b, db);
            if (na != nb)
                return 0;
            for (int k = 0; k < na && k < KT_MAX_DIMS; k++)
                if (da[k] != db[k])
                    return 0;
        } else if (kt__attr_get_i(d, a) != kt__attr_get_i(d, b)) {
            return 0;
        }
    }
    return 1;
}
