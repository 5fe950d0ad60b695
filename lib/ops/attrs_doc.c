/* The op reference table of docs/ktg.md, generated from the attribute lists so the docs
 * cannot drift from the table (tests/test_op_attrs.c compares the two). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "lib/ops/attrs.h"
#include "lib/ops/op_desc.h"

typedef struct out_buf {
    char *buf;
    size_t size, len;
} out_buf;

static void put(out_buf *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *at = o->len < o->size ? o->buf + o->len : NULL;
    int w = vsnprintf(at, at ? o->size - o->len : 0, fmt, ap);
    va_end(ap);
    if (w > 0)
        o->len += (size_t)w;
}

static const char *const type_names[] = {"bool", "int", "int64", "float", "enum", "shape"};

static void put_default(out_buf *o, const kt__attr_desc *a)
{
    if (a->required)
        put(o, "**required**");
    else if (a->type == KT__ATTR_FLOAT)
        put(o, "%g", a->def_f);
    else if (a->type == KT__ATTR_ENUM)
        put(o, "%s", a->values[a->def_i]);
    else if (a->type == KT__ATTR_SHAPE)
        put(o, "[]");
    else
        put(o, "%lld", (long long)a->def_i);
}

size_t kt__attrs_reference(char *buf, size_t size)
{
    out_buf o = {buf, size, 0};
    if (buf != NULL && size > 0)
        buf[0] = '\0';
    put(&o, "| op | attribute | type | default | valid | meaning |\n");
    put(&o, "|---|---|---|---|---|---|\n");
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const kt__op_desc *d = kt__op_get((kt_op)op);
        if (d->n_attrs == 0) {
            put(&o, "| %s | | | | | no attributes |\n", d->name);
            continue;
        }
        for (int i = 0; i < d->n_attrs; i++) {
            const kt__attr_desc *a = &d->attrs[i];
            char range[160];
            kt__attr_range_text(a, range, sizeof range);
            put(&o, "| %s | %s | %s | ", i == 0 ? d->name : "", a->name, type_names[a->type]);
            put_default(&o, a);
            put(&o, " | %s | %s |\n", range, a->doc);
        }
    }
    return o.len;
}
