/* rope through libkt for tests/crosscheck/rope_transformers.py: reads x [B,T,H,D] (f32),
 * positions [B,T] (i64) and an output gradient (f32) as raw little-endian files, runs rope's
 * forward and backward with the attributes given as name=value (the names of rope's attribute
 * list), writes y and x's gradient the same way.
 *
 * usage: rope_helper X POS GY Y GX B T H D [name=value ...] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/kt.h"
#include "lib/ops/attrs.h"

static void *read_all(const char *path, size_t bytes)
{
    void *p = malloc(bytes + 1);
    FILE *f = fopen(path, "rb");
    if (p == NULL || f == NULL || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "rope_helper: cannot read %zu bytes from %s\n", bytes, path);
        exit(1);
    }
    fclose(f);
    return p;
}

static void write_all(const char *path, const void *p, size_t bytes)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, bytes, f) != bytes || fclose(f) != 0) {
        fprintf(stderr, "rope_helper: cannot write %s\n", path);
        exit(1);
    }
}

/* name=value into at, by rope's attribute list */
static void set_attr(kt_op_attrs *at, const char *arg)
{
    const char *eq = strchr(arg, '=');
    const kt__attr_desc *a = eq ? kt__attr_find(KT_OP_ROPE, arg, (size_t)(eq - arg)) : NULL;
    if (a == NULL) {
        fprintf(stderr, "rope_helper: '%s' is not name=value of a rope attribute\n", arg);
        exit(2);
    }
    const char *v = eq + 1;
    if (a->type == KT__ATTR_FLOAT) {
        kt__attr_set_f(a, at, strtod(v, NULL));
    } else if (a->type == KT__ATTR_ENUM) {
        int found = -1;
        for (int i = 0; i < a->n_values; i++)
            if (strcmp(v, a->values[i]) == 0)
                found = i;
        if (found < 0) {
            fprintf(stderr, "rope_helper: %s has no value '%s'\n", a->name, v);
            exit(2);
        }
        kt__attr_set_i(a, at, found);
    } else {
        kt__attr_set_i(a, at, strtoll(v, NULL, 10));
    }
}

int main(int argc, char **argv)
{
    if (argc < 10) {
        fprintf(stderr, "usage: rope_helper X POS GY Y GX B T H D [name=value ...]\n");
        return 2;
    }
    const int64_t shape[4] = {atoll(argv[6]), atoll(argv[7]), atoll(argv[8]), atoll(argv[9])};
    kt_op_attrs at = kt_op_defaults(KT_OP_ROPE);
    for (int i = 10; i < argc; i++)
        set_attr(&at, argv[i]);
    const int64_t n = shape[0] * shape[1] * shape[2] * shape[3], ntok = shape[0] * shape[1];
    const size_t bytes = (size_t)n * sizeof(float);
    kt_tensor in[2], y, gy, gin[2];
    kt_tensor_init(&in[0], read_all(argv[1], bytes), KT_F32, 4, shape);
    kt_tensor_init(&in[1], read_all(argv[2], (size_t)ntok * 8), KT_I64, 2, shape);
    kt_tensor_init(&gy, read_all(argv[3], bytes), KT_F32, 4, shape);
    kt_tensor_init(&y, malloc(bytes), KT_F32, 4, shape);
    kt_tensor_init(&gin[0], malloc(bytes), KT_F32, 4, shape);
    memset(&gin[1], 0, sizeof gin[1]);
    if (kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL) != KT_OK ||
        kt_op_backward(KT_OP_ROPE, &at, in, 2, &y, 1, &gy, gin, NULL) != KT_OK) {
        fprintf(stderr, "rope_helper: %s\n", kt_last_error());
        return 1;
    }
    write_all(argv[4], y.data, bytes);
    write_all(argv[5], gin[0].data, bytes);
    free(in[0].data), free(in[1].data), free(gy.data), free(y.data), free(gin[0].data);
    return 0;
}
