/* safetensors: opening and validating files, reading tensors, writing files.
 *
 * The reader trusts nothing in the file: every header field is checked, all size arithmetic
 * is overflow-checked, and the data section must be exactly tiled by the tensors (no holes,
 * no overlaps, no trailing bytes), as the format's specification requires so that a file
 * cannot smuggle unaccounted bytes (polyglot files). Tensor data is copied as-is, which is
 * right only on a little-endian host. A sharded checkpoint is opened in st_sharded.c, on top
 * of the one-file reader here.
 */
#define _DEFAULT_SOURCE /* madvise: glibc's posix_madvise ignores POSIX_MADV_DONTNEED */
#include "kt/io.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/core/error.h"
#include "lib/core/read_upto.h"
#include "lib/io/json.h"
#include "lib/io/st_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian and libkt copies it without conversion"
#endif

#define METADATA_KEY "__metadata__"
#define NAME_MAX_SHOWN KT__ST_NAME_SHOWN

typedef kt__st_entry st_entry;

/* ---- small helpers --------------------------------------------------------------------------- */

static kt_status errno_error(int err, const char *path, const char *what)
{
    char text[128];
    if (strerror_r(err, text, sizeof text) != 0)
        snprintf(text, sizeof text, "errno %d", err);
    return kt__error(KT_EIO, "%s: %s: %s", path, what, text);
}

static int mul_overflows_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a)
        return 1;
    *out = a * b;
    return 0;
}

/* numel * bits / 8: 1 when too large, 2 when not a whole number of bytes (packed 4- and 6-bit
 * dtypes). The product of the nonzero dimensions must stay within kt_tensor_init's bound
 * (INT64_MAX / 16) even when a zero makes the tensor empty, because strides are computed from
 * it and every entry is handed out as a kt_tensor. */
static int tensor_bytes(unsigned bits, int ndim, const int64_t *shape, uint64_t *bytes_out)
{
    uint64_t product = 1, total;
    int empty = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0)
            empty = 1;
        else if (mul_overflows_u64(product, (uint64_t)shape[d], &product) ||
                 product > INT64_MAX / 16) /* kt_tensor_init's limit: a view must be valid */
            return 1;
    }
    if (mul_overflows_u64(empty ? 0 : product, bits, &total))
        return 1;
    if (total % 8 != 0)
        return 2;
    *bytes_out = total / 8;
    return 0;
}

static int compare_entry_names(const void *a, const void *b)
{
    return strcmp((*(const st_entry *const *)a)->name, (*(const st_entry *const *)b)->name);
}

static int compare_entry_offsets(const void *a, const void *b)
{
    const st_entry *x = *(const st_entry *const *)a, *y = *(const st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int compare_member_keys(const void *a, const void *b)
{
    return strcmp((*(const kt__json_value *const *)a)->key,
                  (*(const kt__json_value *const *)b)->key);
}

static int compare_strings(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* ---- header validation ----------------------------------------------------------------------- */

/* Every dtype of the format. Those libkt holds as tensors come first; the others open (a
 * checkpoint may mix them in, e.g. FP8 weights with their scales) but have no tensor view:
 * kt_st_read_convert turns F64 into a float dtype, the rest are refused where read. */
static const struct {
    const char *name;
    kt_dtype dtype; /* KT_DTYPE_COUNT where libkt has none */
    unsigned bits;
} format_dtypes[] = {
    {"F32", KT_F32, 32},        {"BF16", KT_BF16, 16},         {"F16", KT_F16, 16},
    {"I32", KT_I32, 32},        {"I64", KT_I64, 64},           {"F64", KT_DTYPE_COUNT, 64},
    {"BOOL", KT_DTYPE_COUNT, 8}, {"U8", KT_DTYPE_COUNT, 8},     {"I8", KT_DTYPE_COUNT, 8},
    {"I16", KT_DTYPE_COUNT, 16}, {"U16", KT_DTYPE_COUNT, 16},   {"U32", KT_DTYPE_COUNT, 32},
    {"U64", KT_DTYPE_COUNT, 64}, {"C64", KT_DTYPE_COUNT, 64},   {"F8_E4M3", KT_DTYPE_COUNT, 8},
    {"F8_E5M2", KT_DTYPE_COUNT, 8}, {"F8_E8M0", KT_DTYPE_COUNT, 8}, {"F4", KT_DTYPE_COUNT, 4},
    {"F6_E2M3", KT_DTYPE_COUNT, 6}, {"F6_E3M2", KT_DTYPE_COUNT, 6}};

static kt_status parse_dtype(const char *label, const char *name, const kt__json_value *v,
                             st_entry *e)
{
    if (v->type != KT__JSON_STRING)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': \"dtype\" is a JSON %s, not a string",
                         label, NAME_MAX_SHOWN, name, kt__json_type_name(v->type));
    for (size_t i = 0; i < sizeof format_dtypes / sizeof format_dtypes[0]; i++) {
        if (strcmp(v->u.string.s, format_dtypes[i].name) == 0) {
            e->file_dtype = format_dtypes[i].name;
            e->has_view = format_dtypes[i].dtype != KT_DTYPE_COUNT;
            e->dtype = e->has_view ? format_dtypes[i].dtype : KT_F32;
            e->bits = format_dtypes[i].bits;
            return KT_OK;
        }
    }
    return kt__error(KT_EFORMAT, "%s: tensor '%.*s': \"%.32s\" is not a safetensors dtype", label,
                     NAME_MAX_SHOWN, name, v->u.string.s);
}

/* A JSON integer that must lie in [0, max]; `what` names it in messages. */
static kt_status parse_count(const char *label, const char *name, const char *what,
                             const kt__json_value *v, uint64_t max, uint64_t *out)
{
    if (v->type != KT__JSON_INT)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': %s is a JSON %s, not an integer", label,
                         NAME_MAX_SHOWN, name, what, kt__json_type_name(v->type));
    if (v->u.integer.negative)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': %s is negative (-%llu)", label,
                         NAME_MAX_SHOWN, name, what, (unsigned long long)v->u.integer.magnitude);
    if (v->u.integer.magnitude > max)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': %s (%llu) is out of range", label,
                         NAME_MAX_SHOWN, name, what, (unsigned long long)v->u.integer.magnitude);
    *out = v->u.integer.magnitude;
    return KT_OK;
}

static kt_status parse_shape(const char *label, const char *name, const kt__json_value *v,
                             st_entry *e)
{
    if (v->type != KT__JSON_ARRAY)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': \"shape\" is a JSON %s, not an array",
                         label, NAME_MAX_SHOWN, name, kt__json_type_name(v->type));
    for (size_t d = 0; d < v->u.list.count; d++) {
        char what[32];
        snprintf(what, sizeof what, "shape[%zu]", d);
        uint64_t dim;
        KT__TRY(parse_count(label, name, what, &v->u.list.items[d], INT64_MAX, &dim));
        if (d < KT_MAX_DIMS)
            e->shape[d] = (int64_t)dim;
    }
    if (v->u.list.count > KT_MAX_DIMS)
        return kt__error(KT_EUNSUPPORTED,
                         "%s: tensor '%.*s': %zu dimensions, more than the %d libkt supports",
                         label, NAME_MAX_SHOWN, name, v->u.list.count, KT_MAX_DIMS);
    e->ndim = (int)v->u.list.count;
    return KT_OK;
}

static kt_status parse_offsets(const char *label, const char *name, const kt__json_value *v,
                               size_t data_size, st_entry *e)
{
    if (v->type != KT__JSON_ARRAY || v->u.list.count != 2)
        return kt__error(KT_EFORMAT,
                         "%s: tensor '%.*s': \"data_offsets\" is not a [begin, end] array", label,
                         NAME_MAX_SHOWN, name);
    KT__TRY(
        parse_count(label, name, "data_offsets[0]", &v->u.list.items[0], UINT64_MAX, &e->begin));
    KT__TRY(parse_count(label, name, "data_offsets[1]", &v->u.list.items[1], UINT64_MAX, &e->end));
    if (e->begin > e->end)
        return kt__error(
            KT_EFORMAT, "%s: tensor '%.*s': data_offsets [%llu, %llu] end before they begin", label,
            NAME_MAX_SHOWN, name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return kt__error(
            KT_EFORMAT,
            "%s: tensor '%.*s': data_offsets [%llu, %llu] extend past the %zu-byte data section",
            label, NAME_MAX_SHOWN, name, (unsigned long long)e->begin, (unsigned long long)e->end,
            data_size);
    return KT_OK;
}

char *kt__st_describe(const kt__st_entry *e, char *buf, size_t size)
{
    size_t at = 0;
    int n = snprintf(buf, size, "%s[", e->has_view ? kt_dtype_name(e->dtype) : e->file_dtype);
    for (int d = 0; d < e->ndim && n >= 0 && (at += (size_t)n) < size; d++)
        n = snprintf(buf + at, size - at, d > 0 ? ",%lld" : "%lld", (long long)e->shape[d]);
    if (n >= 0 && (at += (size_t)n) < size)
        snprintf(buf + at, size - at, "]");
    return buf;
}

static kt_status check_size(const char *label, const st_entry *e)
{
    uint64_t bytes = 0;
    char desc[96];
    kt__st_describe(e, desc, sizeof desc);
    int bad = tensor_bytes(e->bits, e->ndim, e->shape, &bytes);
    if (bad == 1)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': shape %s is too large", label,
                         NAME_MAX_SHOWN, e->name, desc);
    if (bad == 2)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': %s is not a whole number of bytes", label,
                         NAME_MAX_SHOWN, e->name, desc);
    if (e->end - e->begin != bytes)
        return kt__error(
            KT_EFORMAT,
            "%s: tensor '%.*s': data_offsets [%llu, %llu] hold %llu bytes but %s needs %llu", label,
            NAME_MAX_SHOWN, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
            (unsigned long long)(e->end - e->begin), desc, (unsigned long long)bytes);
    return KT_OK;
}

static kt_status parse_entry(const char *label, const kt__json_value *m, size_t data_size,
                             st_entry *e)
{
    static const char *const keys[3] = {"dtype", "shape", "data_offsets"};
    const kt__json_value *fields[3] = {NULL, NULL, NULL};
    const char *name = m->key;
    if (m->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': entry is a JSON %s, not an object", label,
                         NAME_MAX_SHOWN, name, kt__json_type_name(m->type));
    for (size_t i = 0; i < m->u.list.count; i++) {
        const kt__json_value *f = &m->u.list.items[i];
        size_t k = 0;
        while (k < 3 && (strlen(keys[k]) != f->key_len || strcmp(keys[k], f->key) != 0))
            k++;
        if (k == 3)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': unknown key \"%.64s\"", label,
                             NAME_MAX_SHOWN, name, f->key);
        if (fields[k] != NULL)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': key \"%s\" appears twice", label,
                             NAME_MAX_SHOWN, name, keys[k]);
        fields[k] = f;
    }
    for (size_t k = 0; k < 3; k++)
        if (fields[k] == NULL)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': missing \"%s\"", label, NAME_MAX_SHOWN,
                             name, keys[k]);
    st_entry r;
    memset(&r, 0, sizeof r);
    r.name = name;
    KT__TRY(parse_dtype(label, name, fields[0], &r));
    KT__TRY(parse_shape(label, name, fields[1], &r));
    KT__TRY(parse_offsets(label, name, fields[2], data_size, &r));
    KT__TRY(check_size(label, &r));
    *e = r;
    return KT_OK;
}

static kt_status parse_metadata(kt__st_shard *f, const kt__json_value *m)
{
    if (f->meta != NULL)
        return kt__error(KT_EFORMAT, "%s: \"" METADATA_KEY "\" appears twice", f->path);
    if (m->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: \"" METADATA_KEY "\" is a JSON %s, not an object",
                         f->path, kt__json_type_name(m->type));
    size_t n = m->u.list.count;
    for (size_t i = 0; i < n; i++) {
        const kt__json_value *v = &m->u.list.items[i];
        if (strlen(v->key) != v->key_len)
            return kt__error(KT_EFORMAT, "%s: a \"" METADATA_KEY "\" key contains a NUL character",
                             f->path);
        if (v->type != KT__JSON_STRING)
            return kt__error(KT_EFORMAT,
                             "%s: \"" METADATA_KEY "\" value of '%.*s' is a JSON %s, not a string",
                             f->path, NAME_MAX_SHOWN, v->key, kt__json_type_name(v->type));
        if (strlen(v->u.string.s) != v->u.string.len)
            return kt__error(KT_EFORMAT,
                             "%s: \"" METADATA_KEY "\" value of '%.*s' contains a NUL character",
                             f->path, NAME_MAX_SHOWN, v->key);
    }
    f->meta_count = n;
    f->meta = malloc((n ? n : 1) * sizeof *f->meta);
    if (f->meta == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->path);
    for (size_t i = 0; i < n; i++)
        f->meta[i] = &m->u.list.items[i];
    qsort(f->meta, n, sizeof *f->meta, compare_member_keys);
    for (size_t i = 1; i < n; i++)
        if (strcmp(f->meta[i - 1]->key, f->meta[i]->key) == 0)
            return kt__error(KT_EFORMAT, "%s: \"" METADATA_KEY "\" key '%.*s' appears twice",
                             f->path, NAME_MAX_SHOWN, f->meta[i]->key);
    return KT_OK;
}

/* The tensors, sorted by offset, must tile [0, data_size) exactly. */
static kt_status check_layout(const kt__st_shard *f)
{
    kt_status s = KT_OK;
    const st_entry **order = malloc((f->count ? f->count : 1) * sizeof *order);
    if (order == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->path);
    for (size_t i = 0; i < f->count; i++)
        order[i] = &f->entries[i];
    qsort(order, f->count, sizeof *order, compare_entry_offsets);
    uint64_t covered = 0;
    for (size_t i = 0; i < f->count && s == KT_OK; i++) {
        const st_entry *e = order[i];
        if (e->begin < covered)
            s = kt__error(KT_EFORMAT,
                          "%s: tensor '%.*s': data_offsets [%llu, %llu] overlap tensor '%.*s'",
                          f->path, NAME_MAX_SHOWN, e->name, (unsigned long long)e->begin,
                          (unsigned long long)e->end, NAME_MAX_SHOWN, order[i - 1]->name);
        else if (e->begin > covered)
            s = kt__error(
                KT_EFORMAT,
                "%s: tensor '%.*s': data section bytes [%llu, %llu) before it belong to no tensor",
                f->path, NAME_MAX_SHOWN, e->name, (unsigned long long)covered,
                (unsigned long long)e->begin);
        else
            covered = e->end;
    }
    if (s == KT_OK && covered != f->data_size)
        s = kt__error(KT_EFORMAT, "%s: %llu trailing bytes after the last tensor's data", f->path,
                      (unsigned long long)(f->data_size - covered));
    free(order);
    return s;
}

static kt_status parse_tensors(kt__st_shard *f, const kt__json_value *root)
{
    size_t n = root->u.list.count;
    f->entries = calloc(n ? n : 1, sizeof *f->entries);
    if (f->entries == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->path);
    for (size_t i = 0; i < n; i++) {
        const kt__json_value *m = &root->u.list.items[i];
        if (strlen(m->key) != m->key_len)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s...': the name contains a NUL character",
                             f->path, NAME_MAX_SHOWN, m->key);
        if (strcmp(m->key, METADATA_KEY) == 0) {
            KT__TRY(parse_metadata(f, m));
            continue;
        }
        KT__TRY(parse_entry(f->path, m, f->data_size, &f->entries[f->count]));
        f->count++;
    }
    return check_layout(f);
}

static const char *last_component(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

kt_status kt__st_shard_parse(const unsigned char *image, size_t size, const char *label,
                             kt__st_shard *f)
{
    kt_status s = KT_OK;
    memset(f, 0, sizeof *f);
    size_t label_len = strlen(label);
    if ((f->path = malloc(label_len + 1)) == NULL) {
        s = kt__error(KT_ENOMEM, "%s: out of memory", label);
        goto done;
    }
    memcpy(f->path, label, label_len + 1);
    f->name = last_component(f->path);
    if (size < 8) {
        s = kt__error(KT_EFORMAT, "%s: %zu bytes is shorter than the 8-byte header length", label,
                      size);
        goto done;
    }
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--)
        header_len = header_len << 8 | image[i];
    if (header_len > KT_ST_MAX_HEADER) {
        s = kt__error(KT_EFORMAT, "%s: header length %llu exceeds the limit of %u bytes", label,
                      (unsigned long long)header_len, KT_ST_MAX_HEADER);
        goto done;
    }
    if (header_len > size - 8) {
        s = kt__error(KT_EFORMAT,
                      "%s: header length %llu extends past the end of the %zu-byte file", label,
                      (unsigned long long)header_len, size);
        goto done;
    }
    f->data = image + 8 + header_len;
    f->data_offset = 8 + (size_t)header_len;
    f->data_size = size - 8 - (size_t)header_len;
    s = kt__json_parse((const char *)image + 8, (size_t)header_len, &f->doc);
    if (s != KT_OK) {
        s = kt__error_context(s, "%s: header", label);
        goto done;
    }
    const kt__json_value *root = kt__json_root(f->doc);
    if (root->type != KT__JSON_OBJECT) {
        s = kt__error(KT_EFORMAT, "%s: header is a JSON %s, not an object", label,
                      kt__json_type_name(root->type));
        goto done;
    }
    s = parse_tensors(f, root);
done:
    if (s != KT_OK)
        kt__st_shard_free(f);
    return s;
}

void kt__st_shard_free(kt__st_shard *f)
{
    if (f->mapped != NULL)
        munmap(f->mapped, f->mapped_size);
    free(f->owned);
    kt__json_free(f->doc);
    free(f->entries);
    free(f->meta);
    free(f->path);
    memset(f, 0, sizeof *f);
}

kt_status kt__st_assemble(kt_st_file *f)
{
    size_t n = 0;
    for (size_t k = 0; k < f->n_shards; k++)
        n += f->shards[k].count;
    f->entries = calloc(n ? n : 1, sizeof *f->entries);
    f->by_name = calloc(n ? n : 1, sizeof *f->by_name);
    if (f->entries == NULL || f->by_name == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
    for (size_t k = 0; k < f->n_shards; k++) {
        kt__st_shard *sh = &f->shards[k];
        for (size_t i = 0; i < sh->count; i++) {
            f->entries[f->count] = sh->entries[i];
            f->entries[f->count].shard = k;
            f->by_name[f->count] = &f->entries[f->count];
            f->count++;
        }
        free(sh->entries);
        sh->entries = NULL;
    }
    qsort(f->by_name, f->count, sizeof *f->by_name, compare_entry_names);
    for (size_t i = 1; i < f->count; i++) {
        const st_entry *a = f->by_name[i - 1], *b = f->by_name[i];
        if (strcmp(a->name, b->name) != 0)
            continue;
        if (a->shard == b->shard)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s' appears twice",
                             f->shards[a->shard].path, NAME_MAX_SHOWN, a->name);
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s' is in two shards, %s and %s", f->label,
                         NAME_MAX_SHOWN, a->name, f->shards[a->shard].path,
                         f->shards[b->shard].path);
    }
    return KT_OK;
}

/* A file of one shard, which it takes over (freeing it on failure). */
static kt_status single_file(kt__st_shard *shard, kt_st_file **file_out)
{
    kt_status s = KT_OK;
    kt_st_file *f = calloc(1, sizeof *f);
    if (f == NULL || (f->shards = calloc(1, sizeof *f->shards)) == NULL ||
        (f->label = malloc(strlen(shard->path) + 1)) == NULL) {
        s = kt__error(KT_ENOMEM, "%s: out of memory", shard->path);
        kt__st_shard_free(shard);
        kt_st_close(f);
        return s;
    }
    strcpy(f->label, shard->path);
    f->shards[0] = *shard;
    f->n_shards = 1;
    s = kt__st_assemble(f);
    if (s != KT_OK) {
        kt_st_close(f);
        return s;
    }
    *file_out = f;
    return KT_OK;
}

/* ---- opening --------------------------------------------------------------------------------- */

/* The data section's size a header declares: the largest data_offsets end (0 where the header
 * is malformed; parse_image then says what is wrong with it). */
static uint64_t declared_data_size(const unsigned char *header, size_t len)
{
    kt__json_doc *doc = NULL;
    if (kt__json_parse((const char *)header, len, &doc) != KT_OK) {
        kt_clear_error();
        return 0;
    }
    const kt__json_value *root = kt__json_root(doc);
    uint64_t end = 0;
    for (size_t i = 0; root->type == KT__JSON_OBJECT && i < root->u.list.count; i++) {
        const kt__json_value *t = &root->u.list.items[i];
        for (size_t j = 0; t->type == KT__JSON_OBJECT && j < t->u.list.count; j++) {
            const kt__json_value *f = &t->u.list.items[j];
            if (strcmp(f->key, "data_offsets") != 0 || f->type != KT__JSON_ARRAY ||
                f->u.list.count != 2)
                continue;
            const kt__json_value *e = &f->u.list.items[1];
            if (e->type == KT__JSON_INT && !e->u.integer.negative &&
                e->u.integer.magnitude > end)
                end = e->u.integer.magnitude;
        }
    }
    kt__json_free(doc);
    return end;
}

/* The fallback for what cannot be mapped (pipes, special files, mmap failures). It reads no
 * more than the file's own header declares: the 8-byte length, the header (when within the
 * limit), and the data section its offsets reach, plus one byte, so that trailing bytes are
 * still found; an endless input (/dev/zero, a stream of garbage) stops there. */
static kt_status read_all(int fd, const char *path, unsigned char **buf_out, size_t *size_out)
{
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    kt_status s = kt__read_upto(fd, path, &buf, &len, &cap, 8);
    if (s == KT_OK && len == 8) {
        uint64_t header_len = 0;
        for (int i = 7; i >= 0; i--)
            header_len = header_len << 8 | buf[i];
        if (header_len <= KT_ST_MAX_HEADER) {
            s = kt__read_upto(fd, path, &buf, &len, &cap, 8 + (size_t)header_len);
            if (s == KT_OK && len == 8 + header_len) {
                /* (an end past what memory could hold is left to parse_image to report) */
                uint64_t data = declared_data_size(buf + 8, (size_t)header_len);
                if (data < SIZE_MAX / 2)
                    s = kt__read_upto(fd, path, &buf, &len, &cap, len + (size_t)data + 1);
            }
        }
    }
    if (s != KT_OK) {
        free(buf);
        return s;
    }
    *buf_out = buf;
    *size_out = len;
    return KT_OK;
}

kt_status kt__st_shard_open(const char *path, kt__st_shard *shard)
{
    kt_status s = KT_OK;
    void *map = NULL;
    size_t size = 0;
    unsigned char *buf = NULL;
    int fd = -1;
    memset(shard, 0, sizeof *shard);
    s = kt_in_open(path, &fd, NULL);
    if (s != KT_OK)
        goto done;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        s = errno_error(errno, path, "cannot stat");
        goto done;
    }
    /* Empty files cannot be mapped; they take the read path and fail validation there. */
    if (S_ISREG(st.st_mode) && st.st_size > 0 && (uintmax_t)st.st_size <= SIZE_MAX) {
        size = (size_t)st.st_size;
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED)
            map = NULL;
    }
    if (map == NULL) {
        s = read_all(fd, path, &buf, &size);
        if (s != KT_OK)
            goto done;
    }
    s = kt__st_shard_parse(map != NULL ? map : buf, size, path, shard);
    if (s != KT_OK)
        goto done;
    shard->mapped = map;
    shard->mapped_size = size;
    shard->owned = buf;
done:
    if (fd >= 0)
        close(fd);
    if (s != KT_OK) {
        if (map != NULL)
            munmap(map, size);
        free(buf);
    }
    return s;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* A directory is a Hugging Face checkpoint: its index when there is one, else its one file. */
static kt_status open_directory(const char *dir, kt_st_file **file_out)
{
    static const char *const names[2] = {"model.safetensors.index.json", "model.safetensors"};
    for (int k = 0; k < 2; k++) {
        size_t n = strlen(dir) + strlen(names[k]) + 2;
        char *path = malloc(n);
        if (path == NULL)
            return kt__error(KT_ENOMEM, "%s: out of memory", dir);
        snprintf(path, n, "%s%s%s", dir, ends_with(dir, "/") ? "" : "/", names[k]);
        struct stat st;
        kt_status s = KT_OK;
        int found = stat(path, &st) == 0;
        if (found)
            s = kt_st_open(path, file_out);
        free(path);
        if (found)
            return s;
    }
    return kt__error(KT_EIO, "%s: a directory without model.safetensors.index.json or "
                     "model.safetensors: not a checkpoint directory", dir);
}

kt_status kt_st_open(const char *path, kt_st_file **file_out)
{
    if (file_out != NULL)
        *file_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (path == NULL || file_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_open: NULL argument");
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return open_directory(path, file_out);
    if (ends_with(path, ".json"))
        return kt__st_open_index(path, file_out);
    kt__st_shard shard;
    KT__TRY(kt__st_shard_open(path, &shard));
    return single_file(&shard, file_out);
}

kt_status kt_st_open_memory(const void *data, size_t size, const char *label, kt_st_file **file_out)
{
    if (file_out != NULL)
        *file_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if ((data == NULL && size > 0) || file_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_open_memory: NULL argument");
    kt__st_shard shard;
    KT__TRY(kt__st_shard_parse(data, size, label != NULL ? label : "<memory>", &shard));
    return single_file(&shard, file_out);
}

void kt_st_close(kt_st_file *file)
{
    if (file == NULL)
        return;
    for (size_t k = 0; file->shards != NULL && k < file->n_shards; k++)
        kt__st_shard_free(&file->shards[k]);
    free(file->shards);
    kt__json_free(file->index);
    free(file->index_meta);
    free(file->index_meta_text);
    free(file->entries);
    free(file->by_name);
    free(file->label);
    free(file);
}

/* ---- reading --------------------------------------------------------------------------------- */

size_t kt_st_count(const kt_st_file *file) { return file != NULL ? file->count : 0; }

const unsigned char *kt__st_entry_data(const kt_st_file *file, const kt__st_entry *e)
{
    return file->shards[e->shard].data + e->begin;
}

const char *kt__st_entry_path(const kt_st_file *file, const kt__st_entry *e)
{
    return file->shards[e->shard].path;
}

void kt__st_release(const kt_st_file *file, const kt__st_entry *e)
{
    const kt__st_shard *sh = &file->shards[e->shard];
    long page = sysconf(_SC_PAGESIZE);
    if (sh->mapped == NULL || page <= 0)
        return;
    uintptr_t lo = (uintptr_t)(sh->data + e->begin), hi = (uintptr_t)(sh->data + e->end);
    uintptr_t p = (uintptr_t)page;
    lo = (lo + p - 1) / p * p;
    hi = hi / p * p;
#ifdef MADV_DONTNEED
    /* Advice only: where it fails the pages just stay resident. */
    if (lo < hi)
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#endif
}

static kt_status no_view(const kt_st_file *file, const st_entry *e)
{
    char desc[96];
    return kt__error(KT_EUNSUPPORTED,
                     "%s: tensor '%.*s' is %s: libkt has no such dtype (it reads F32, BF16, F16, "
                     "I32 and I64, and converts F64 to a float dtype with kt_st_read_convert)",
                     kt__st_entry_path(file, e), NAME_MAX_SHOWN, e->name,
                     kt__st_describe(e, desc, sizeof desc));
}

static kt_tensor entry_view(const kt_st_file *file, const st_entry *e)
{
    kt_tensor t;
    /* Cannot fail: parse_entry validated dtype, ndim and shape against kt_tensor_init's own
     * bounds (tensor_bytes). The view is read-only in practice (a mapping is PROT_READ) but
     * kt_tensor has no const form. */
    kt_tensor_init(&t, (void *)kt__st_entry_data(file, e), e->dtype, e->ndim, e->shape);
    return t;
}

const kt__st_entry *kt__st_find_entry(const kt_st_file *file, const char *name)
{
    st_entry key = {.name = name};
    const st_entry *kp = &key;
    const st_entry **hit =
        bsearch(&kp, file->by_name, file->count, sizeof *file->by_name, compare_entry_names);
    return hit != NULL ? *hit : NULL;
}

kt_status kt_st_entry(const kt_st_file *file, size_t i, const char **name_out, kt_tensor *view_out)
{
    if (file == NULL)
        return kt__error(KT_EINVAL, "kt_st_entry: file is NULL");
    if (i >= file->count)
        return kt__error(KT_EINVAL, "%s: tensor index %zu out of range (the file has %zu)",
                         file->label, i, file->count);
    const st_entry *e = &file->entries[i];
    if (view_out != NULL && !e->has_view)
        return no_view(file, e);
    if (name_out != NULL)
        *name_out = e->name;
    if (view_out != NULL)
        *view_out = entry_view(file, e);
    return KT_OK;
}

kt_status kt_st_entry_info(const kt_st_file *file, size_t i, kt_st_info *info_out)
{
    if (file == NULL || info_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_entry_info: NULL argument");
    if (i >= file->count)
        return kt__error(KT_EINVAL, "%s: tensor index %zu out of range (the file has %zu)",
                         file->label, i, file->count);
    const st_entry *e = &file->entries[i];
    kt_st_info r;
    memset(&r, 0, sizeof r);
    r.name = e->name;
    r.file_dtype = e->file_dtype;
    r.dtype = e->has_view ? e->dtype : KT_DTYPE_COUNT;
    r.ndim = e->ndim;
    memcpy(r.shape, e->shape, sizeof r.shape);
    r.nbytes = (size_t)(e->end - e->begin);
    r.shard = e->shard;
    r.file_offset = (uint64_t)file->shards[e->shard].data_offset + e->begin;
    *info_out = r;
    return KT_OK;
}

kt_status kt_st_lookup(const kt_st_file *file, const char *name, size_t *index_out)
{
    if (file == NULL || name == NULL || index_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_lookup: NULL argument");
    const st_entry *e = kt__st_find_entry(file, name);
    if (e == NULL)
        return kt__error(KT_EINVAL, "%s: no tensor named '%.*s'", file->label, NAME_MAX_SHOWN,
                         name);
    *index_out = (size_t)(e - file->entries);
    return KT_OK;
}

kt_status kt_st_find(const kt_st_file *file, const char *name, kt_tensor *view_out)
{
    if (file == NULL || name == NULL || view_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_find: NULL argument");
    const st_entry *e = kt__st_find_entry(file, name);
    if (e == NULL)
        return kt__error(KT_EINVAL, "%s: no tensor named '%.*s'", file->label, NAME_MAX_SHOWN,
                         name);
    if (!e->has_view)
        return no_view(file, e);
    *view_out = entry_view(file, e);
    return KT_OK;
}

kt_status kt_st_read(const kt_st_file *file, const char *name, kt_tensor *dst)
{
    if (file == NULL || name == NULL || dst == NULL)
        return kt__error(KT_EINVAL, "kt_st_read: NULL argument");
    const st_entry *e = kt__st_find_entry(file, name);
    if (e == NULL)
        return kt__error(KT_EINVAL, "%s: no tensor named '%.*s'", file->label, NAME_MAX_SHOWN,
                         name);
    char want[96], have[96];
    if (!e->has_view || e->dtype != dst->dtype || e->ndim != dst->ndim ||
        memcmp(e->shape, dst->shape, (size_t)e->ndim * sizeof e->shape[0]) != 0)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' is %s in the file but the destination is %s",
                         kt__st_entry_path(file, e), NAME_MAX_SHOWN, name,
                         kt__st_describe(e, have, sizeof have),
                         kt_tensor_describe(dst, want, sizeof want));
    if (dst->device.type != KT_DEVICE_CPU || !kt_tensor_is_contiguous(dst))
        return kt__error(KT_EINVAL,
                         "%s: tensor '%.*s': the destination must be a contiguous CPU tensor",
                         kt__st_entry_path(file, e), NAME_MAX_SHOWN, name);
    size_t bytes = (size_t)(e->end - e->begin);
    if (bytes > 0 && dst->data == NULL)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s': the destination has no data",
                         kt__st_entry_path(file, e), NAME_MAX_SHOWN, name);
    if (bytes > 0) {
        memcpy(dst->data, kt__st_entry_data(file, e), bytes);
        kt__st_release(file, e);
    }
    return KT_OK;
}

const char *kt_st_metadata(const kt_st_file *file, const char *key)
{
    if (file == NULL || key == NULL)
        return NULL;
    for (size_t i = 0; i < file->index_meta_count; i++)
        if (strcmp(file->index_meta[2 * i], key) == 0)
            return file->index_meta[2 * i + 1];
    kt__json_value probe = {.key = key};
    const kt__json_value *pp = &probe;
    for (size_t k = 0; k < file->n_shards; k++) {
        const kt__st_shard *sh = &file->shards[k];
        if (sh->meta_count == 0)
            continue;
        const kt__json_value **hit =
            bsearch(&pp, sh->meta, sh->meta_count, sizeof *sh->meta, compare_member_keys);
        if (hit != NULL)
            return (*hit)->u.string.s;
    }
    return NULL;
}

int kt_st_is_sharded(const kt_st_file *file) { return file != NULL && file->sharded; }

size_t kt_st_shard_count(const kt_st_file *file) { return file != NULL ? file->n_shards : 0; }

const char *kt_st_shard_name(const kt_st_file *file, size_t k)
{
    return file != NULL && k < file->n_shards ? file->shards[k].name : NULL;
}

const char *kt_st_shard_path(const kt_st_file *file, size_t k)
{
    return file != NULL && k < file->n_shards ? file->shards[k].path : NULL;
}

const char *kt_st_entry_file(const kt_st_file *file, size_t i)
{
    return file != NULL && i < file->count ? file->shards[file->entries[i].shard].name : NULL;
}

/* ---- writing --------------------------------------------------------------------------------- */

/* Measures, and writes when buf is set: one code path sizes and fills the header, so the
 * two cannot disagree. */
typedef struct sink {
    unsigned char *buf;
    size_t len;
    int overflow;
} sink;

static void put(sink *k, const void *p, size_t n)
{
    if (n > SIZE_MAX - k->len) {
        k->overflow = 1;
        return;
    }
    if (k->buf != NULL && n > 0)
        memcpy(k->buf + k->len, p, n);
    k->len += n;
}

static void put_str(sink *k, const char *s) { put(k, s, strlen(s)); }

static void put_u64(sink *k, uint64_t v)
{
    char text[24];
    put(k, text, (size_t)snprintf(text, sizeof text, "%llu", (unsigned long long)v));
}

static void put_json_string(sink *k, const char *s)
{
    static const char from[] = "\"\\\b\f\n\r\t", to[] = "\"\\bfnrt";
    put_str(k, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        const char *hit = memchr(from, *p, sizeof from - 1);
        char esc[8];
        if (hit != NULL) {
            esc[0] = '\\';
            esc[1] = to[hit - from];
            put(k, esc, 2);
        } else if (*p < 0x20) {
            put(k, esc, (size_t)snprintf(esc, sizeof esc, "\\u%04x", *p));
        } else {
            put(k, p, 1);
        }
    }
    put_str(k, "\"");
}

static const char *safetensors_dtype(kt_dtype dtype)
{
    for (size_t i = 0; i < sizeof format_dtypes / sizeof format_dtypes[0]; i++)
        if (format_dtypes[i].dtype == dtype)
            return format_dtypes[i].name;
    return "?";
}

/* The header JSON, padded with spaces so the data section starts 8-byte aligned. */
static void put_header(sink *k, const kt_st_item *items, size_t n, const char *const *metadata)
{
    size_t start = k->len;
    put_str(k, "{");
    int first = 1;
    if (metadata != NULL && metadata[0] != NULL) {
        put_str(k, "\"" METADATA_KEY "\":{");
        for (size_t i = 0; metadata[i] != NULL; i += 2) {
            if (i > 0)
                put_str(k, ",");
            put_json_string(k, metadata[i]);
            put_str(k, ":");
            put_json_string(k, metadata[i + 1]);
        }
        put_str(k, "}");
        first = 0;
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < n; i++) {
        const kt_tensor *t = &items[i].tensor;
        uint64_t bytes = kt_tensor_nbytes(t);
        if (!first)
            put_str(k, ",");
        first = 0;
        put_json_string(k, items[i].name);
        put_str(k, ":{\"dtype\":\"");
        put_str(k, safetensors_dtype(t->dtype));
        put_str(k, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            if (d > 0)
                put_str(k, ",");
            put_u64(k, (uint64_t)t->shape[d]);
        }
        put_str(k, "],\"data_offsets\":[");
        put_u64(k, offset);
        put_str(k, ",");
        put_u64(k, offset + bytes);
        put_str(k, "]}");
        offset += bytes;
    }
    put_str(k, "}");
    while ((k->len - start) % 8 != 0)
        put_str(k, " ");
}

static kt_status check_name(const char *who, const char *kind, const char *name)
{
    if (!kt__json_utf8_valid(name, strlen(name)))
        return kt__error(KT_EINVAL, "%s: %s '%.*s' is not valid UTF-8", who, kind, NAME_MAX_SHOWN,
                         name);
    return KT_OK;
}

/* Sorts a copy of the names and reports the first one that appears twice. */
static kt_status check_unique(const char *who, const char *kind, const char **names, size_t n)
{
    qsort(names, n, sizeof *names, compare_strings);
    for (size_t i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            return kt__error(KT_EINVAL, "%s: %s '%.*s' appears twice", who, kind, NAME_MAX_SHOWN,
                             names[i]);
    return KT_OK;
}

static kt_status check_item(const char *who, const kt_st_item *item, size_t i, uint64_t *bytes_out)
{
    const kt_tensor *t = &item->tensor;
    if (item->name == NULL)
        return kt__error(KT_EINVAL, "%s: item %zu has no name", who, i);
    KT__TRY(check_name(who, "tensor name", item->name));
    if (strcmp(item->name, METADATA_KEY) == 0)
        return kt__error(KT_EINVAL, "%s: \"" METADATA_KEY "\" is reserved, not a tensor name", who);
    if (kt_dtype_size(t->dtype) == 0 || t->ndim < 0 || t->ndim > KT_MAX_DIMS)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' has an invalid dtype or ndim", who,
                         NAME_MAX_SHOWN, item->name);
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0)
            return kt__error(KT_EINVAL, "%s: tensor '%.*s' has a negative dimension", who,
                             NAME_MAX_SHOWN, item->name);
    if (t->device.type != KT_DEVICE_CPU)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' is not on the CPU", who, NAME_MAX_SHOWN,
                         item->name);
    if (!kt_tensor_is_contiguous(t))
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' is not contiguous", who, NAME_MAX_SHOWN,
                         item->name);
    uint64_t bytes;
    if (tensor_bytes(8 * (unsigned)kt_dtype_size(t->dtype), t->ndim, t->shape, &bytes) ||
        bytes > SIZE_MAX)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' is too large", who, NAME_MAX_SHOWN,
                         item->name);
    if (bytes > 0 && t->data == NULL)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' has no data", who, NAME_MAX_SHOWN,
                         item->name);
    *bytes_out = bytes;
    return KT_OK;
}

/* Validates everything a writer needs and returns the header's padded length and the data
 * section's length. */
static kt_status plan(const char *who, const kt_st_item *items, size_t n,
                      const char *const *metadata, size_t *header_out, size_t *data_out)
{
    if (items == NULL && n > 0)
        return kt__error(KT_EINVAL, "%s: items is NULL", who);
    kt_status s = KT_OK;
    size_t n_meta = 0;
    while (metadata != NULL && metadata[n_meta] != NULL) {
        if (metadata[n_meta + 1] == NULL)
            return kt__error(KT_EINVAL, "%s: metadata key '%.*s' has no value", who, NAME_MAX_SHOWN,
                             metadata[n_meta]);
        n_meta += 2;
    }
    size_t n_names = n > n_meta / 2 ? n : n_meta / 2;
    const char **names = malloc((n_names ? n_names : 1) * sizeof *names);
    if (names == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", who);
    uint64_t data = 0;
    for (size_t i = 0; i < n && s == KT_OK; i++) {
        uint64_t bytes = 0;
        s = check_item(who, &items[i], i, &bytes);
        if (s == KT_OK && bytes > SIZE_MAX - data)
            s = kt__error(KT_EINVAL, "%s: the tensors total more than %zu bytes", who,
                          (size_t)SIZE_MAX);
        data += bytes;
        names[i] = items[i].name;
    }
    if (s == KT_OK)
        s = check_unique(who, "tensor name", names, n);
    for (size_t i = 0; i < n_meta && s == KT_OK; i++)
        s = check_name(who, i % 2 ? "metadata value" : "metadata key", metadata[i]);
    for (size_t i = 0; i < n_meta / 2; i++)
        names[i] = metadata[2 * i];
    if (s == KT_OK)
        s = check_unique(who, "metadata key", names, n_meta / 2);
    free(names);
    if (s != KT_OK)
        return s;
    sink k = {0};
    put_header(&k, items, n, metadata);
    if (k.overflow || k.len > KT_ST_MAX_HEADER)
        return kt__error(KT_EINVAL, "%s: the header would exceed %u bytes", who, KT_ST_MAX_HEADER);
    if (data > SIZE_MAX - 8 - k.len)
        return kt__error(KT_EINVAL, "%s: the file would exceed %zu bytes", who, (size_t)SIZE_MAX);
    *header_out = k.len;
    *data_out = (size_t)data;
    return KT_OK;
}

/* The 8-byte length prefix and the padded header. */
static void put_prefix(sink *k, size_t header_len, const kt_st_item *items, size_t n,
                       const char *const *metadata)
{
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; i++)
        len_bytes[i] = (unsigned char)((uint64_t)header_len >> (8 * i));
    put(k, len_bytes, 8);
    put_header(k, items, n, metadata);
}

kt_status kt_st_serialized_size(const kt_st_item *items, size_t n, const char *const *metadata,
                                size_t *bytes_out)
{
    if (bytes_out == NULL)
        return kt__error(KT_EINVAL, "kt_st_serialized_size: bytes_out is NULL");
    size_t header, data;
    KT__TRY(plan("kt_st_serialized_size", items, n, metadata, &header, &data));
    *bytes_out = 8 + header + data;
    return KT_OK;
}

kt_status kt_st_serialize(const kt_st_item *items, size_t n, const char *const *metadata, void *buf,
                          size_t size)
{
    size_t header, data;
    KT__TRY(plan("kt_st_serialize", items, n, metadata, &header, &data));
    if (buf == NULL || size < 8 + header + data)
        return kt__error(KT_EINVAL,
                         "kt_st_serialize: the buffer holds %zu bytes but %zu are needed",
                         buf == NULL ? 0 : size, 8 + header + data);
    sink k = {.buf = buf};
    put_prefix(&k, header, items, n, metadata);
    for (size_t i = 0; i < n; i++)
        put(&k, items[i].tensor.data, kt_tensor_nbytes(&items[i].tensor));
    return KT_OK;
}

kt_status kt_st_save(const char *path, const kt_st_item *items, size_t n,
                     const char *const *metadata)
{
    if (path == NULL)
        return kt__error(KT_EINVAL, "kt_st_save: path is NULL");
    size_t header, data;
    KT__TRY(plan("kt_st_save", items, n, metadata, &header, &data));
    kt_status s = KT_OK;
    kt_out_file *out = NULL;
    sink k = {.buf = malloc(8 + header)};
    if (k.buf == NULL) {
        s = kt__error(KT_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    put_prefix(&k, header, items, n, metadata);
    s = kt_out_open(path, &out);
    if (s != KT_OK)
        goto done;
    s = kt_out_write(out, k.buf, k.len);
    for (size_t i = 0; i < n && s == KT_OK; i++)
        s = kt_out_write(out, items[i].tensor.data, kt_tensor_nbytes(&items[i].tensor));
    if (s == KT_OK)
        s = kt_out_commit(out);
    else
        kt_out_discard(out);
done:
    free(k.buf);
    return s;
}
