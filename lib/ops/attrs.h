/* Op attributes described by the op table: each op's row lists its attributes (name as .ktg
 * spells it, type, where it lives in kt_op_attrs, default or required, valid range), and
 * everything that handles attributes — defaults, validation, .ktg parsing, CSE equality,
 * .ktp reading and writing, the op reference in docs/ktg.md — walks that list, so adding an
 * attribute is one line in its op's file. */
#ifndef KT_OPS_ATTRS_H
#define KT_OPS_ATTRS_H

#include <stddef.h>
#include <stdint.h>

#include "kt/ops.h"

typedef enum kt__attr_type {
    KT__ATTR_BOOL,  /* int field, 0 or 1 */
    KT__ATTR_INT,   /* int field */
    KT__ATTR_INT64, /* int64_t field */
    KT__ATTR_FLOAT, /* float field, finite */
    KT__ATTR_ENUM,  /* enum field (stored as int): one of `values`, by index */
    KT__ATTR_SHAPE  /* int64_t[KT_MAX_DIMS] field plus an int count at count_offset */
} kt__attr_type;

typedef struct kt__attr_desc {
    const char *name; /* as .ktg spells it (and messages and docs) */
    kt__attr_type type;
    size_t offset;       /* of the field in kt_op_attrs */
    size_t count_offset; /* shape: of its entry count */
    int required;        /* no default: a made-up value would silently mean something else */
    int64_t def_i;       /* the default of bool, int, int64 and enum attributes */
    double def_f;        /* the default of float attributes */
    /* The valid range: int types (a shape: each entry) [lo, hi]; float [flo, fhi]. */
    int64_t lo, hi;
    double flo, fhi;
    const char *const *values; /* enum: the value names, the enum's values in order */
    int n_values;
    const char *doc; /* one line for the op reference */
} kt__attr_desc;

/* Row builders for the op files' lists (designated, so the fields read by name). */
#define KT__ATTR_OFF(field) offsetof(kt_op_attrs, field)
#define KT__A_BOOL(nm, field, def, d)                                                        \
    {.name = nm, .type = KT__ATTR_BOOL, .offset = KT__ATTR_OFF(field), .def_i = def,         \
     .lo = 0, .hi = 1, .doc = d}
#define KT__A_INT(nm, field, def, l, h, d)                                                   \
    {.name = nm, .type = KT__ATTR_INT, .offset = KT__ATTR_OFF(field), .def_i = def, .lo = l, \
     .hi = h, .doc = d}
#define KT__A_INT_REQ(nm, field, l, h, d)                                                    \
    {.name = nm, .type = KT__ATTR_INT, .offset = KT__ATTR_OFF(field), .required = 1,         \
     .lo = l, .hi = h, .doc = d}
#define KT__A_I64(nm, field, def, l, h, d)                                                   \
    {.name = nm, .type = KT__ATTR_INT64, .offset = KT__ATTR_OFF(field), .def_i = def,        \
     .lo = l, .hi = h, .doc = d}
#define KT__A_I64_REQ(nm, field, l, h, d)                                                    \
    {.name = nm, .type = KT__ATTR_INT64, .offset = KT__ATTR_OFF(field), .required = 1,       \
     .lo = l, .hi = h, .doc = d}
#define KT__A_FLOAT(nm, field, def, l, h, d)                                                 \
    {.name = nm, .type = KT__ATTR_FLOAT, .offset = KT__ATTR_OFF(field), .def_f = def,        \
     .flo = l, .fhi = h, .doc = d}
#define KT__A_FLOAT_REQ(nm, field, l, h, d)                                                  \
    {.name = nm, .type = KT__ATTR_FLOAT, .offset = KT__ATTR_OFF(field), .required = 1,       \
     .flo = l, .fhi = h, .doc = d}
#define KT__A_ENUM(nm, field, def, names, d)                                                 \
    {.name = nm, .type = KT__ATTR_ENUM, .offset = KT__ATTR_OFF(field), .def_i = def,         \
     .lo = 0, .hi = (int64_t)(sizeof names / sizeof names[0]) - 1, .values = names,          \
     .n_values = (int)(sizeof names / sizeof names[0]), .doc = d}
#define KT__A_SHAPE_REQ(nm, field, count, l, h, d)                                           \
    {.name = nm, .type = KT__ATTR_SHAPE, .offset = KT__ATTR_OFF(field),                      \
     .count_offset = KT__ATTR_OFF(count), .required = 1, .lo = l, .hi = h, .doc = d}
#define KT__ATTR_LIST(list) .attrs = list, .n_attrs = (int)(sizeof list / sizeof list[0])

/* The stamp kt_op_defaults writes into made_for: non-zero, and unlikely in stray memory. */
#define KT__ATTRS_STAMP(op) (0x6b740000u + (unsigned)(op) + 1u)

/* The attribute list of op (n_out receives its length; NULL, 0 for an invalid op). */
const kt__attr_desc *kt__attrs_of(kt_op op, int *n_out);
/* The attribute of op called name, or NULL. */
const kt__attr_desc *kt__attr_find(kt_op op, const char *name, size_t len);

/* Field access: integer types (bool, int, int64, enum) as int64; floats as double. */
int64_t kt__attr_get_i(const kt__attr_desc *a, const kt_op_attrs *at);
void kt__attr_set_i(const kt__attr_desc *a, kt_op_attrs *at, int64_t v);
double kt__attr_get_f(const kt__attr_desc *a, const kt_op_attrs *at);
void kt__attr_set_f(const kt__attr_desc *a, kt_op_attrs *at, double v);
/* A shape attribute's entries and count. */
int kt__attr_get_shape(const kt__attr_desc *a, const kt_op_attrs *at, int64_t *dims);
void kt__attr_set_shape(const kt__attr_desc *a, kt_op_attrs *at, const int64_t *dims, int n);

/* Whether v is in the attribute's range (integer types; a shape checks each entry). */
int kt__attr_in_range_i(const kt__attr_desc *a, int64_t v);
int kt__attr_in_range_f(const kt__attr_desc *a, double v);
/* "0 or 1", "-1073741824..1073741824", "causal, same or valid" (for messages and docs). */
void kt__attr_range_text(const kt__attr_desc *a, char *buf, size_t size);
/* "trans_a or trans_b" or "" (the op's attribute names, for messages) */
void kt__attr_names_text(kt_op op, char *buf, size_t size);

/* attrs (NULL: the op's defaults) resolved into *out: refused, naming the op and what to
 * do, when the op has attributes and attrs was not made by kt_op_defaults(op), or when a
 * required attribute was not set. */
kt_status kt__attrs_resolve(kt_op op, const kt_op_attrs *attrs, kt_op_attrs *out);
/* Every listed attribute of a resolved struct in its range (after the op's own checks,
 * which say more where they apply). */
kt_status kt__attrs_check_ranges(kt_op op, const kt_op_attrs *attrs);
/* Whether two resolved structs for op are equal in every listed attribute (CSE). */
int kt__attrs_equal(kt_op op, const kt_op_attrs *a, const kt_op_attrs *b);
/* Whether a required attribute still holds the "not set" mark kt_op_defaults leaves in it
 * (an integer's most negative value, a float's NaN, a shape's count -1). */
int kt__attr_is_unset(const kt__attr_desc *a, const kt_op_attrs *at);

/* The op reference of docs/ktg.md (a Markdown table generated from the lists) into buf; the
 * length it needs (without the NUL) is returned, as snprintf does. */
size_t kt__attrs_reference(char *buf, size_t size);

#endif
