/* libFuzzer target: the safetensors reader.
 *
 * Opens the input as a file image; when it is accepted, reads every tensor by name into a
 * buffer of its size and checks the bytes against the view, looks up metadata, and writes the
 * tensors out again: anything the reader accepts must serialize and read back the same. A
 * tensor of a dtype libkt has not must refuse a view; an f32 one read as bf16 must round as
 * kt_f32_to_bf16_1 does. A broken invariant aborts (a crash to libFuzzer). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt/io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void roundtrip(const kt_st_file *f, kt_st_item *items, size_t n)
{
    size_t bytes = 0;
    if (kt_st_serialized_size(items, n, NULL, &bytes) != KT_OK)
        abort(); /* a readable file whose tensors cannot be written */
    unsigned char *buf = malloc(bytes ? bytes : 1);
    if (buf == NULL)
        return;
    kt_st_file *g = NULL;
    if (kt_st_serialize(items, n, NULL, buf, bytes) != KT_OK ||
        kt_st_open_memory(buf, bytes, "roundtrip", &g) != KT_OK || kt_st_count(g) != n)
        abort();
    for (size_t i = 0; i < n; i++) {
        kt_tensor a, b;
        if (kt_st_find(g, items[i].name, &b) != KT_OK || kt_st_find(f, items[i].name, &a) != KT_OK ||
            a.dtype != b.dtype || !kt_tensor_same_shape(&a, &b) ||
            memcmp(a.data, b.data, kt_tensor_nbytes(&a)) != 0)
            abort();
    }
    kt_st_close(g);
    free(buf);
}

/* A tensor of a dtype libkt has not: no view, no plain read; F64 converts to f32. */
static void foreign(const kt_st_file *f, size_t i, const kt_st_info *info)
{
    kt_tensor view, dst;
    if (kt_st_entry(f, i, NULL, &view) == KT_OK || kt_st_find(f, info->name, &view) == KT_OK ||
        kt_tensor_init(&dst, NULL, KT_F32, info->ndim, info->shape) != KT_OK)
        abort();
    size_t bytes = kt_tensor_nbytes(&dst);
    dst.data = malloc(bytes ? bytes : 1);
    if (dst.data == NULL)
        return;
    int is_f64 = strcmp(info->file_dtype, "F64") == 0;
    if ((kt_st_read_convert(f, info->name, &dst) == KT_OK) != is_f64 ||
        (kt_st_read(f, info->name, &dst) == KT_OK))
        abort();
    free(dst.data);
}

/* A float tensor read converted to bf16 must equal the f32 read rounded. */
static void converted(const kt_st_file *f, const char *name, const kt_tensor *dst)
{
    if (dst->dtype != KT_F32)
        return;
    size_t n = (size_t)kt_tensor_numel(dst);
    kt_tensor b;
    if (kt_tensor_init(&b, NULL, KT_BF16, dst->ndim, dst->shape) != KT_OK)
        abort();
    b.data = malloc(n ? 2 * n : 1);
    if (b.data == NULL)
        return;
    if (kt_st_read_convert(f, name, &b) != KT_OK)
        abort();
    const float *x = dst->data;
    const uint16_t *y = b.data;
    for (size_t i = 0; i < n; i++)
        if (y[i] != kt_f32_to_bf16_1(x[i]))
            abort();
    free(b.data);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kt_st_file *f = NULL;
    if (kt_st_open_memory(data, size, "fuzz", &f) != KT_OK)
        return 0;
    size_t n = kt_st_count(f), m = 0;
    kt_st_item *items = calloc(n ? n : 1, sizeof *items);
    int ok = items != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        const char *name = NULL;
        kt_tensor view, dst;
        kt_st_info info;
        if (kt_st_entry_info(f, i, &info) != KT_OK || kt_st_entry_file(f, i) == NULL)
            abort();
        if (info.dtype == KT_DTYPE_COUNT) {
            foreign(f, i, &info);
            continue;
        }
        if (kt_st_entry(f, i, &name, &view) != KT_OK ||
            kt_tensor_init(&dst, NULL, view.dtype, view.ndim, view.shape) != KT_OK)
            abort(); /* an accepted entry must be readable and describable */
        size_t bytes = kt_tensor_nbytes(&dst);
        if (bytes != info.nbytes)
            abort();
        dst.data = malloc(bytes ? bytes : 1);
        if (dst.data == NULL) {
            ok = 0;
            break;
        }
        items[m].name = name;
        items[m++].tensor = dst;
        if (kt_st_read(f, name, &dst) != KT_OK ||
            (bytes > 0 && memcmp(dst.data, view.data, bytes) != 0))
            abort();
        converted(f, name, &dst);
    }
    (void)kt_st_metadata(f, "format");
    kt_tensor probe;
    (void)kt_st_find(f, "", &probe);
    if (ok)
        roundtrip(f, items, m);
    for (size_t i = 0; items != NULL && i < m; i++)
        free(items[i].tensor.data);
    free(items);
    kt_st_close(f);
    return 0;
}
