/* The C half of the PyTorch cross-check (st_torch_roundtrip.py).
 *
 *   st_helper write FILE   writes the reference tensors with kt_st_save
 *   st_helper check FILE   reads a file written by Python and verifies every value (FILE may
 *                          be a sharded checkpoint: its index or its directory)
 *   st_helper convert IN OUT   reads every float tensor of IN (F32, BF16, F16, F64) converted
 *                          to f32, bf16 and f16 (kt_st_read_convert) and writes them to OUT as
 *                          "<name>.f32", "<name>.bf16", "<name>.f16", for the script to
 *                          compare with torch's own conversions
 *
 * Both sides compute the values from the same formulas (keep them in step with the script):
 *   float dtypes: v(i) = ((i * 7) % 17 - 8) * 0.25          (exact in bf16 and f16)
 *   i32:          v(i) = ((i * 7919) % 4096 - 2048) * 2^19
 *   i64:          v(i) = ((i * 7919) % 4096 - 2048) * 2^40
 * Exit status 0 on success, 1 on a mismatch or error (with a message on stderr).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/io.h"

typedef struct spec {
    const char *name;
    kt_dtype dtype;
    int ndim;
    int64_t shape[KT_MAX_DIMS];
} spec;

static const spec specs[] = {
    {"f32", KT_F32, 3, {2, 3, 4}},
    {"bf16", KT_BF16, 1, {7}},
    {"weird \"name\" \xc3\xa9\\", KT_F16, 2, {3, 5}},
    {"i32", KT_I32, 0, {0}},
    {"i64", KT_I64, 4, {2, 2, 2, 2}},
    {"empty", KT_F32, 2, {0, 3}},
};
#define N_SPECS (sizeof specs / sizeof specs[0])

static int64_t int_base(int64_t i) { return (i * 7919) % 4096 - 2048; }

/* The expected bytes of element i, written into out. */
static void expected(kt_dtype dtype, int64_t i, unsigned char *out)
{
    float f = (float)(((i * 7) % 17 - 8) * 0.25);
    uint16_t h;
    int32_t i32;
    int64_t i64;
    switch (dtype) {
    case KT_F32:
        memcpy(out, &f, 4);
        break;
    case KT_BF16:
        h = kt_f32_to_bf16_1(f);
        memcpy(out, &h, 2);
        break;
    case KT_F16:
        h = kt_f32_to_f16_1(f);
        memcpy(out, &h, 2);
        break;
    case KT_I32:
        i32 = (int32_t)(int_base(i) * ((int64_t)1 << 19));
        memcpy(out, &i32, 4);
        break;
    default:
        i64 = int_base(i) * ((int64_t)1 << 40);
        memcpy(out, &i64, 8);
        break;
    }
}

static int fail(const char *what)
{
    fprintf(stderr, "st_helper: %s: %s\n", what, kt_last_error());
    return 1;
}

static int do_write(const char *path)
{
    kt_st_item items[N_SPECS];
    int rc = 0;
    for (size_t k = 0; k < N_SPECS; k++) {
        items[k].name = specs[k].name;
        if (kt_tensor_init(&items[k].tensor, NULL, specs[k].dtype, specs[k].ndim, specs[k].shape) !=
            KT_OK)
            return fail("kt_tensor_init");
        size_t bytes = kt_tensor_nbytes(&items[k].tensor), es = kt_dtype_size(specs[k].dtype);
        unsigned char *data = malloc(bytes ? bytes : 1);
        if (data == NULL)
            return fail("malloc");
        for (size_t i = 0; i < bytes / es; i++)
            expected(specs[k].dtype, (int64_t)i, data + i * es);
        items[k].tensor.data = data;
    }
    const char *const meta[] = {"source", "kt", "escape \"me\"", "line\nbreak", NULL};
    if (kt_st_save(path, items, N_SPECS, meta) != KT_OK)
        rc = fail("kt_st_save");
    for (size_t k = 0; k < N_SPECS; k++)
        free(items[k].tensor.data);
    return rc;
}

static int check_one(const kt_st_file *f, const spec *s)
{
    kt_tensor t;
    if (kt_tensor_init(&t, NULL, s->dtype, s->ndim, s->shape) != KT_OK)
        return fail("kt_tensor_init");
    size_t bytes = kt_tensor_nbytes(&t), es = kt_dtype_size(s->dtype);
    unsigned char *data = malloc(bytes ? bytes : 1);
    if (data == NULL)
        return fail("malloc");
    t.data = data;
    int rc = 0;
    if (kt_st_read(f, s->name, &t) != KT_OK) {
        rc = fail("kt_st_read");
    } else {
        for (size_t i = 0; i < bytes / es && rc == 0; i++) {
            unsigned char want[8];
            expected(s->dtype, (int64_t)i, want);
            if (memcmp(want, data + i * es, es) != 0) {
                fprintf(stderr, "st_helper: tensor '%s' differs at element %zu\n", s->name, i);
                rc = 1;
            }
        }
    }
    free(data);
    return rc;
}

static int do_check(const char *path)
{
    kt_st_file *f = NULL;
    if (kt_st_open(path, &f) != KT_OK)
        return fail("kt_st_open");
    int rc = 0;
    if (kt_st_count(f) != N_SPECS) {
        fprintf(stderr, "st_helper: %zu tensors, expected %zu\n", kt_st_count(f), (size_t)N_SPECS);
        rc = 1;
    }
    for (size_t k = 0; k < N_SPECS && rc == 0; k++)
        rc = check_one(f, &specs[k]);
    const char *source = kt_st_metadata(f, "source");
    if (rc == 0 && (source == NULL || strcmp(source, "torch") != 0)) {
        fprintf(stderr, "st_helper: metadata 'source' is %s, expected 'torch'\n",
                source ? source : "missing");
        rc = 1;
    }
    kt_st_close(f);
    return rc;
}

static int do_convert(const char *in, const char *out)
{
    static const kt_dtype targets[3] = {KT_F32, KT_BF16, KT_F16};
    kt_st_file *f = NULL;
    if (kt_st_open(in, &f) != KT_OK)
        return fail("kt_st_open");
    size_t n = kt_st_count(f);
    kt_st_item *items = calloc(3 * n + 1, sizeof *items);
    char *names = calloc(3 * n + 1, 256);
    int rc = items == NULL || names == NULL;
    size_t m = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        kt_st_info info;
        if (kt_st_entry_info(f, i, &info) != KT_OK)
            return fail("kt_st_entry_info");
        for (int k = 0; k < 3 && rc == 0; k++) {
            kt_st_item *it = &items[m];
            it->name = names + 256 * m;
            snprintf(names + 256 * m, 256, "%s.%s", info.name, kt_dtype_name(targets[k]));
            kt_tensor_init(&it->tensor, NULL, targets[k], info.ndim, info.shape);
            it->tensor.data = malloc(kt_tensor_nbytes(&it->tensor) + 1);
            m++;
            if (it->tensor.data == NULL || kt_st_read_convert(f, info.name, &it->tensor) != KT_OK)
                rc = fail("kt_st_read_convert");
        }
    }
    if (rc == 0 && kt_st_save(out, items, m, NULL) != KT_OK)
        rc = fail("kt_st_save");
    for (size_t i = 0; items != NULL && i < m; i++)
        free(items[i].tensor.data);
    free(items);
    free(names);
    kt_st_close(f);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "convert") == 0)
        return do_convert(argv[2], argv[3]);
    if (argc == 3 && strcmp(argv[1], "write") == 0)
        return do_write(argv[2]);
    if (argc == 3 && strcmp(argv[1], "check") == 0)
        return do_check(argv[2]);
    fprintf(stderr, "usage: st_helper write|check FILE | st_helper convert IN OUT\n");
    return 2;
}
