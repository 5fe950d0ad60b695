/* kt-data's prepared token files: a safetensors file holding the 1-D tensors `tokens` (I32),
 * `loss_mask` (U8) and `doc_index` (I32) of one length, with kt.format = "kt-tokens-1",
 * kt.vocab, kt.bytes and kt.tokenizer in its metadata (docs/training.md, "Preparing data").
 *
 * The library validates the file (kt_st_open: the header, the offsets, every byte covered)
 * and gives its metadata, shapes and where each tensor's bytes are; it has no U8 dtype, so
 * the mask has no view, and data.c reads all three tensors from the file by offset as it
 * reads a flat file's windows. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/train.h"

#define PREPARED_FORMAT "kt-tokens-1"

int prepared_detect(FILE *f, int64_t size, int *is_prepared)
{
    unsigned char head[9];
    *is_prepared = 0;
    if (size < 9)
        return 0;
    if (fseeko(f, 0, SEEK_SET) != 0 || fread(head, 1, sizeof head, f) != sizeof head)
        return train_error("cannot read the data file's first bytes: %s", strerror(errno));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | head[i];
    /* a flat token file whose first 8 bytes read as a header length that fits the file and
     * that is followed by '{' is vanishingly rare: the ids would have to spell it */
    *is_prepared = n >= 2 && n <= (uint64_t)size - 8 && n <= KT_ST_MAX_HEADER && head[8] == '{';
    return 0;
}

/* ---- the metadata and the tensors ------------------------------------------------------------ */

static int metadata_int(const token_data *d, const kt_st_file *f, const char *key, int required,
                        int64_t *out)
{
    const char *v = kt_st_metadata(f, key);
    *out = 0;
    if (v == NULL) {
        if (required)
            return train_error("%s: a kt-data file without %s in its metadata", d->path, key);
        return 0;
    }
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || errno != 0 || x < 0 || (required && x == 0))
        return train_error("%s: metadata %s is '%s', not a %s integer", d->path, key, v,
                           required ? "positive" : "non-negative");
    *out = x;
    return 0;
}

/* The tensor's length and file offset after checking that it is a 1-D tensor of `dtype`
 * (the format's name). */
static int tensor_at(const token_data *d, const kt_st_file *f, const char *name,
                     const char *dtype, int64_t *len, int64_t *offset)
{
    size_t i;
    kt_st_info info;
    if (kt_st_lookup(f, name, &i) != KT_OK || kt_st_entry_info(f, i, &info) != KT_OK) {
        kt_clear_error();
        return train_error("%s: a kt-data file without the tensor '%s' (it needs tokens, "
                           "loss_mask and doc_index)", d->path, name);
    }
    if (strcmp(info.file_dtype, dtype) != 0 || info.ndim != 1)
        return train_error("%s: '%s' is a %d-D %s tensor; kt-tokens-1 has it 1-D %s", d->path,
                           name, info.ndim, info.file_dtype, dtype);
    *len = info.shape[0];
    *offset = (int64_t)info.file_offset;
    return 0;
}

int prepared_open(token_data *d)
{
    kt_st_file *f;
    if (kt_st_open(d->path, &f) != KT_OK)
        return train_fail("the data file starts as a safetensors file but cannot be read",
                          kt_last_error());
    int rc = 0;
    const char *format = kt_st_metadata(f, "kt.format");
    const char *tokenizer = kt_st_metadata(f, "kt.tokenizer");
    if (format == NULL)
        rc = train_error("%s is a safetensors file without kt.format in its metadata: not a "
                         "prepared token file (make one with kt-data)", d->path);
    else if (strcmp(format, PREPARED_FORMAT) != 0)
        rc = train_error("%s: kt.format is '%s'; this kt-train reads '%s'", d->path, format,
                         PREPARED_FORMAT);
    int64_t n_mask = 0, n_docs = 0;
    if (rc == 0)
        rc = tensor_at(d, f, "tokens", "I32", &d->n_tokens, &d->header) ||
             tensor_at(d, f, "loss_mask", "U8", &n_mask, &d->mask_offset) ||
             tensor_at(d, f, "doc_index", "I32", &n_docs, &d->doc_offset) ||
             metadata_int(d, f, "kt.vocab", 1, &d->vocab) ||
             metadata_int(d, f, "kt.bytes", 0, &d->source_bytes);
    if (rc == 0 && (n_mask != d->n_tokens || n_docs != d->n_tokens))
        rc = train_error("%s: a mask of the wrong length: %s holds %lld values, tokens %lld",
                         d->path, n_mask != d->n_tokens ? "loss_mask" : "doc_index",
                         (long long)(n_mask != d->n_tokens ? n_mask : n_docs),
                         (long long)d->n_tokens);
    if (rc == 0 && d->bound >= 0 && d->vocab > d->bound)
        rc = train_error("%s was tokenised with a vocabulary of %lld (%s), larger than the "
                         "program's %lld: prepare the data with the model's tokenizer, or "
                         "compile the model with a vocabulary of at least %lld", d->path,
                         (long long)d->vocab, tokenizer ? tokenizer : "kt.tokenizer unset",
                         (long long)d->bound, (long long)d->vocab);
    kt_st_close(f);
    d->prepared = 1;
    d->token_bytes = 4;
    return rc;
}
