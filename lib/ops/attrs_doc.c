/* The op reference table of docs/ktg.md, generated from the attribute lists so the docs
 * cannot drift from the table (tests/test_op_attrs.c compares the two). */

#include "lib/core/text.h"
#include "lib/ops/attrs.h"
#include "lib/ops/op_desc.h"

static const char *const type_names[] = {"bool", "int", "int64", "float", "enum", "shape"};

static void put_default(kt__text *o, const kt__attr_desc *a)
{
    if (a->required)
        kt__say(o, "**required**");
    else if (a->type == KT__ATTR_FLOAT)
        kt__say(o, "%g", a->def_f);
    else if (a->type == KT__ATTR_ENUM)
        kt__say(o, "%s", a->values[a->def_i]);
    else if (a->type == KT__ATTR_SHAPE)
        kt__say(o, "[]");
    else
        kt__say(o, "%lld", (long long)a->def_i);
}

size_t kt__attrs_reference(char *buf, size_t size)
{
    kt__text o = {buf, size, 0};
    if (buf != NULL && size > 0)
        buf[0] = '\0';
    kt__say(&o, "| op | attribute | type | default | valid | meaning |\n");
    kt__say(&o, "|---|---|---|---|---|---|\n");
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const kt__op_desc *d = kt__op_get((kt_op)op);
        if (d->n_attrs == 0) {
            kt__say(&o, "| %s | | | | | no attributes |\n", d->name);
            continue;
        }
        for (int i = 0; i < d->n_attrs; i++) {
            const kt__attr_desc *a = &d->attrs[i];
            char range[160];
            kt__attr_range_text(a, range, sizeof range);
            kt__say(&o, "| %s | %s | %s | ", i == 0 ? d->name : "", a->name, type_names[a->type]);
            put_default(&o, a);
            kt__say(&o, " | %s | %s |\n", range, a->doc);
        }
    }
    return o.len;
}
