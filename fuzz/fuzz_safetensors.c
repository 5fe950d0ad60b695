/* libFuzzer target: the safetensors reader.
 *
 * Opens the input as a file image; when it is accepted, reads every tensor by name into a
 * buffer of its size and checks the bytes against the view, looks up metadata, and writes the
 * tensors out again: anything the reader accepts must serialize and read back the same. A
 * broken invariant aborts (a crash to libFuzzer). */
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kt_st_file *f = NULL;
    if (kt_st_open_memory(data, size, "fuzz", &f) != KT_OK)
        return 0;
    size_t n = kt_st_count(f);
    kt_st_item *items = calloc(n ? n : 1, sizeof *items);
    int ok = items != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        const char *name = NULL;
        kt_tensor view, dst;
        if (kt_st_entry(f, i, &name, &view) != KT_OK ||
            kt_tensor_init(&dst, NULL, view.dtype, view.ndim, view.shape) != KT_OK)
            abort(); /* an accepted entry must be readable and describable */
        size_t bytes = kt_tensor_nbytes(&dst);
        dst.data = malloc(bytes ? bytes : 1);
        if (dst.data == NULL) {
            ok = 0;
            break;
        }
        items[i].name = name;
        items[i].tensor = dst;
        if (kt_st_read(f, name, &dst) != KT_OK ||
            (bytes > 0 && memcmp(dst.data, view.data, bytes) != 0))
            abort();
    }
    (void)kt_st_metadata(f, "format");
    kt_tensor probe;
    (void)kt_st_find(f, "", &probe);
    if (ok)
        roundtrip(f, items, n);
    for (size_t i = 0; items != NULL && i < n; i++)
        free(items[i].tensor.data);
    free(items);
    kt_st_close(f);
    return 0;
}
