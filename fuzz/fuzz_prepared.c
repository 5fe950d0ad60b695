/* libFuzzer target: kt-train's reader of kt-data's prepared token files
 * (tools/kt-train/prepared.c: detection, then the metadata, tensors and offsets).
 *
 * The input is the whole file, written to a temporary file (the reader streams from a FILE).
 * When it is accepted, the three tensors must lie inside the file: tokens (i32), loss_mask
 * (u8) and doc_index (i32) of n_tokens values each, at the offsets found. A broken invariant
 * aborts. The reader's messages go to stderr (libFuzzer's -close_fd_mask=2 hides them). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/kt-train/train.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char path[64];

static void remove_file(void) { unlink(path); }

static int inside(int64_t offset, int64_t n, int64_t width, int64_t size)
{
    return offset >= 0 && n >= 0 && n <= (size - offset) / width;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (path[0] == '\0') {
        strcpy(path, "/tmp/kt_fuzz_prepared.XXXXXX");
        int fd = mkstemp(path);
        if (fd < 0)
            abort();
        close(fd);
        atexit(remove_file);
    }
    FILE *f = fopen(path, "w+b");
    if (f == NULL || (size > 0 && fwrite(data, 1, size, f) != size) || fflush(f) != 0)
        abort();
    int is_prepared = 0;
    token_data d;
    memset(&d, 0, sizeof d);
    d.path = path;
    d.file = f;
    d.bound = 257; /* a byte-level model's vocabulary */
    if (prepared_detect(f, (int64_t)size, &is_prepared) == 0 && is_prepared &&
        prepared_open(&d) == 0) {
        int64_t n = d.n_tokens, s = (int64_t)size;
        if (!inside(d.header, n, 4, s) || !inside(d.mask_offset, n, 1, s) ||
            !inside(d.doc_offset, n, 4, s) || d.vocab <= 0 || d.vocab > d.bound ||
            d.source_bytes < 0)
            abort();
    }
    kt_clear_error();
    fclose(f);
    return 0;
}
