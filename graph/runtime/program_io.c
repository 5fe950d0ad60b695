/* The .ktp program file.
 *
 *   "KTPROGRM" | u32 version | u32 flags (0) | u64 body size | body | u32 CRC-32 of all before
 *
 * The body holds the counts, then the buffer, step and entry tables field by field, then the
 * name pool, all little-endian. Ops are stored by name, so renumbering the op list does not
 * silently change a program. Loading checks the magic, the version, every size against the
 * bytes present, the checksum, and then validates the whole program (shapes re-inferred,
 * lifetimes, the memory plan), so a damaged file is an error, never a crash. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/core/error.h"
#include "lib/core/read_upto.h"
#include "graph/program_internal.h"
#include "graph/runtime/bytes.h"
#include "kt/io.h"
#include "lib/ops/attrs.h"
#include "lib/ops/op_desc.h"

#define KTP_MAGIC "KTPROGRM"
/* 2: step flags (recompute); 3: the state keep-none flag (KT__STEP_STATE_RECOMPUTES); 4: rope's
 * attributes, 5: topk_router's scoring, group and scaling fields, 6: the fields of sum/mean
 * (keepdim), expand (size) and clamp (min, max), 7: attention's scale, causal, window and
 * softcap, 8: moe's intermediate and names, 9: cast's dtype, and 10: cp_attention's layout,
 * each of which grows the
 * attribute record, so files of older versions (a shorter record) are refused by their
 * version. */
#define KTP_VERSION 10u
#define KTP_OLDEST_VERSION 10u
#define KTP_MAX_OP_NAME 32

/* Smallest encoded record sizes, to bound counts before allocating. */
#define BUF_RECORD (4 + 4 + 8 * KT_MAX_DIMS + 4 + 8 + 8 + 4 + 4 + 4)
#define STEP_MIN_RECORD 64
#define ENTRY_RECORD (4 + 4 + 4 + 4 + 4 + 4 + 4)

/* The attribute record of a step: every kt_op_attrs field that some op's attribute list
 * names (ops/attrs.h), once, in the order of the fields in the struct; bool, int and enum
 * fields as i32, int64 as i64, float as f32, a shape as its i32 count then KT_MAX_DIMS i64.
 * The layout is derived from the table, so no field is listed here; it is the layout of
 * version KTP_OLDEST_VERSION on (a field added to kt_op_attrs for a new attribute grows the
 * record and needs a new KTP_VERSION, which is then also the oldest one read). Non-op steps use it too (a fill's value is the
 * alpha field). */
#define KTP_MAX_SLOTS 96
/* every field takes at least 4 bytes, so the distinct fields always fit */
_Static_assert(sizeof(kt_op_attrs) / 4 <= KTP_MAX_SLOTS, "KTP_MAX_SLOTS below kt_op_attrs' fields");

/* The distinct fields, by their first byte in kt_op_attrs (a shape starts at its count). */
static size_t slot_start(const kt__attr_desc *a)
{
    return a->type == KT__ATTR_SHAPE && a->count_offset < a->offset ? a->count_offset
                                                                      : a->offset;
}

static int record_slots(const kt__attr_desc **slots)
{
    int n = 0;
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const kt__op_desc *row = kt__op_get_builtin((kt_op)op);
        const int n_attrs = row->n_attrs;
        const kt__attr_desc *list = row->attrs;
        for (int i = 0; i < n_attrs; i++) {
            const size_t at = slot_start(&list[i]);
            int k = 0;
            while (k < n && slot_start(slots[k]) < at)
                k++;
            if (k < n && slot_start(slots[k]) == at)
                continue; /* a field two ops share (dim) is one slot */
            memmove(&slots[k + 1], &slots[k], (size_t)(n - k) * sizeof *slots);
            slots[k] = &list[i];
            n++;
        }
    }
    return n;
}

/* The record's layout, derived once from the built-in rows. */
static const kt__attr_desc *record[KTP_MAX_SLOTS];
static int n_record;
static pthread_once_t record_once = PTHREAD_ONCE_INIT;

static void record_init(void)
{
    n_record = record_slots(record);
}

static void put_attrs(kt__writer *w, const kt_op_attrs *a)
{
    pthread_once(&record_once, record_init);
    const kt__attr_desc *const *slots = record;
    const int n = n_record;
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *d = slots[i];
        int64_t dims[KT_MAX_DIMS];
        switch (d->type) {
        case KT__ATTR_FLOAT:
            kt__put_f32(w, (float)kt__attr_get_f(d, a));
            break;
        case KT__ATTR_INT64:
            kt__put_i64(w, kt__attr_get_i(d, a));
            break;
        case KT__ATTR_SHAPE:
            kt__put_i32(w, kt__attr_get_shape(d, a, dims));
            for (int k = 0; k < KT_MAX_DIMS; k++)
                kt__put_i64(w, dims[k]);
            break;
        default:
            kt__put_i32(w, (int32_t)kt__attr_get_i(d, a));
            break;
        }
    }
}

/* The record into a zeroed struct; an op step's is then stamped for its op (the loader's
 * validation checks every listed attribute against its range). */
static void get_attrs(kt__reader *r, kt_op op, kt_op_attrs *a)
{
    memset(a, 0, sizeof *a);
    pthread_once(&record_once, record_init);
    const kt__attr_desc *const *slots = record;
    const int n = n_record;
    for (int i = 0; i < n; i++) {
        const kt__attr_desc *d = slots[i];
        int64_t dims[KT_MAX_DIMS];
        switch (d->type) {
        case KT__ATTR_FLOAT:
            kt__attr_set_f(d, a, kt__get_f32(r));
            break;
        case KT__ATTR_INT64:
            kt__attr_set_i(d, a, kt__get_i64(r));
            break;
        case KT__ATTR_SHAPE: {
            int32_t count = kt__get_i32(r);
            for (int k = 0; k < KT_MAX_DIMS; k++)
                dims[k] = kt__get_i64(r);
            kt__attr_set_shape(d, a, dims, KT_MAX_DIMS);
            memcpy((char *)a + d->count_offset, &count, sizeof count);
            break;
        }
        default:
            kt__attr_set_i(d, a, kt__get_i32(r));
            break;
        }
    }
    if (op < KT_OP_COUNT)
        a->made_for = KT__ATTRS_STAMP(op);
}

static void put_body(kt__writer *w, const kt_program *p)
{
    kt__put_i32(w, p->n_bufs);
    kt__put_i32(w, p->n_steps);
    kt__put_i32(w, p->n_forward);
    for (int r = 0; r < 3; r++)
        kt__put_i32(w, p->n_entries[r]);
    kt__put_i32(w, p->loss_buf);
    for (int r = 0; r < KT__REGION_COUNT; r++)
        kt__put_u64(w, p->region_bytes[r]);
    kt__put_u64(w, p->lower_bound);
    kt__put_u64(w, p->strings.len);
    for (int32_t i = 0; i < p->n_bufs; i++) {
        const kt__pbuf *b = &p->bufs[i];
        kt__put_u32(w, (uint32_t)b->meta.dtype);
        kt__put_i32(w, b->meta.ndim);
        for (int d = 0; d < KT_MAX_DIMS; d++)
            kt__put_i64(w, d < b->meta.ndim ? b->meta.shape[d] : 0);
        kt__put_i32(w, b->region);
        kt__put_u64(w, b->offset);
        kt__put_u64(w, b->bytes);
        kt__put_i32(w, b->first);
        kt__put_i32(w, b->last);
        kt__put_i32(w, b->storage);
    }
    for (int32_t i = 0; i < p->n_steps; i++) {
        const kt__pstep *s = &p->steps[i];
        kt__put_i32(w, s->kind);
        const char *op = s->kind <= KT__STEP_BACKWARD ? kt_op_name(s->op) : "";
        uint32_t len = (uint32_t)strlen(op);
        kt__put_u32(w, len);
        kt__put_bytes(w, op, len);
        put_attrs(w, &s->attrs);
        kt__put_i32(w, s->n_in);
        kt__put_i32(w, s->n_out);
        for (int k = 0; k < KT_OP_MAX_IN; k++)
            kt__put_i32(w, s->in[k]);
        for (int k = 0; k < KT_OP_MAX_OUT; k++)
            kt__put_i32(w, s->out[k]);
        for (int k = 0; k < KT_OP_MAX_OUT; k++)
            kt__put_i32(w, s->gout[k]);
        for (int k = 0; k < KT_OP_MAX_IN; k++)
            kt__put_i32(w, s->gin[k]);
        kt__put_i32(w, s->scratch);
        kt__put_i32(w, s->name);
        kt__put_i32(w, s->flags);
        kt__put_f64(w, s->flops);
    }
    for (int r = 0; r < 3; r++) {
        for (int32_t i = 0; i < p->n_entries[r]; i++) {
            const kt__pentry *e = &p->entries[r][i];
            kt__put_i32(w, e->name);
            kt__put_i32(w, e->buf);
            kt__put_i32(w, e->grad_buf);
            kt__put_i32(w, (int32_t)e->init.kind);
            kt__put_f32(w, e->init.a);
            kt__put_f32(w, e->init.b);
            kt__put_i32(w, e->shard_dim);
        }
    }
    kt__put_bytes(w, p->strings.data, p->strings.len);
}

static size_t encode(const kt_program *p, unsigned char *buf, size_t cap)
{
    kt__writer body = {NULL, 0, 0};
    put_body(&body, p);
    kt__writer w = {buf, 0, cap};
    kt__put_bytes(&w, KTP_MAGIC, 8);
    kt__put_u32(&w, KTP_VERSION);
    kt__put_u32(&w, 0);
    kt__put_u64(&w, body.pos);
    put_body(&w, p);
    if (buf != NULL && w.pos + 4 <= cap)
        kt__put_u32(&w, kt__crc32(buf, w.pos));
    else
        w.pos += 4;
    return w.pos;
}

kt_status kt_program_serialized_size(const kt_program *p, size_t *bytes_out)
{
    if (p == NULL || bytes_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_serialized_size: NULL argument");
    *bytes_out = encode(p, NULL, 0);
    return KT_OK;
}

kt_status kt_program_serialize(const kt_program *p, void *buf, size_t size)
{
    if (p == NULL || buf == NULL)
        return kt__error(KT_EINVAL, "kt_program_serialize: NULL argument");
    size_t need = encode(p, NULL, 0);
    if (size < need)
        return kt__error(KT_EINVAL, "kt_program_serialize: the buffer holds %zu bytes, %zu "
                         "needed", size, need);
    encode(p, buf, size);
    return KT_OK;
}

kt_status kt_program_save(const kt_program *p, const char *path)
{
    if (p == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_program_save: NULL argument");
    size_t n = encode(p, NULL, 0);
    unsigned char *buf = malloc(n);
    if (buf == NULL)
        return kt__error(KT_ENOMEM, "kt_program_save: out of memory (%zu bytes)", n);
    encode(p, buf, n);
    kt_out_file *out = NULL;
    kt_status status = kt_out_open(path, &out);
    if (status == KT_OK)
        status = kt_out_write(out, buf, n);
    if (status == KT_OK)
        status = kt_out_commit(out);
    else
        kt_out_discard(out);
    free(buf);
    return status;
}

/* ---- loading ----------------------------------------------------------------------------------- */

static kt_status read_counts(kt__reader *r, kt_program *p, uint64_t *strings_len)
{
    p->n_bufs = kt__get_i32(r);
    p->n_steps = kt__get_i32(r);
    p->n_forward = kt__get_i32(r);
    for (int k = 0; k < 3; k++)
        p->n_entries[k] = kt__get_i32(r);
    p->loss_buf = kt__get_i32(r);
    for (int k = 0; k < KT__REGION_COUNT; k++)
        p->region_bytes[k] = kt__get_u64(r);
    p->lower_bound = kt__get_u64(r);
    *strings_len = kt__get_u64(r);
    if (r->bad)
        return kt__error(KT_EFORMAT, "program file: truncated header");
    size_t left = r->size - r->pos;
    uint64_t entries = 0;
    for (int k = 0; k < 3; k++) {
        if (p->n_entries[k] < 0)
            return kt__error(KT_EFORMAT, "program file: negative table size");
        entries += (uint64_t)p->n_entries[k];
    }
    if (p->n_bufs < 0 || p->n_steps < 0 || p->n_forward < 0 ||
        (uint64_t)p->n_bufs * BUF_RECORD > left || (uint64_t)p->n_steps * STEP_MIN_RECORD > left ||
        entries * ENTRY_RECORD > left || *strings_len > left)
        return kt__error(KT_EFORMAT, "program file: table sizes exceed the file");
    return KT_OK;
}

static kt_status read_tables(kt__reader *r, kt_program *p)
{
    for (int32_t i = 0; i < p->n_bufs; i++) {
        kt__pbuf *b = &p->bufs[i];
        uint32_t dtype = kt__get_u32(r);
        int32_t ndim = kt__get_i32(r);
        int64_t shape[KT_MAX_DIMS];
        for (int d = 0; d < KT_MAX_DIMS; d++)
            shape[d] = kt__get_i64(r);
        if (r->bad || dtype >= KT_DTYPE_COUNT ||
            kt_tensor_init(&b->meta, NULL, (kt_dtype)dtype, ndim, shape) != KT_OK)
            return kt__error(KT_EFORMAT, "program file: buffer %d has an invalid tensor", i);
        b->region = kt__get_i32(r);
        b->offset = kt__get_u64(r);
        b->bytes = kt__get_u64(r);
        b->first = kt__get_i32(r);
        b->last = kt__get_i32(r);
        b->storage = kt__get_i32(r);
    }
    for (int32_t i = 0; i < p->n_steps; i++) {
        kt__pstep *s = &p->steps[i];
        s->kind = kt__get_i32(r);
        uint32_t len = kt__get_u32(r);
        if (r->bad || len > KTP_MAX_OP_NAME)
            return kt__error(KT_EFORMAT, "program file: step %d is damaged", i);
        char op[KTP_MAX_OP_NAME + 1];
        const unsigned char *name = kt__get_bytes(r, len);
        if (name == NULL)
            return kt__error(KT_EFORMAT, "program file: truncated at step %d", i);
        memcpy(op, name, len);
        op[len] = '\0';
        s->op = KT_OP_COUNT;
        if (s->kind == KT__STEP_FORWARD || s->kind == KT__STEP_BACKWARD) {
            if (kt_op_from_name(op, &s->op) != KT_OK)
                return kt__error(KT_EFORMAT, "program file: step %d uses op '%s', which this "
                                 "libkt does not have", i, op);
        }
        get_attrs(r, s->op, &s->attrs);
        s->n_in = kt__get_i32(r);
        s->n_out = kt__get_i32(r);
        for (int k = 0; k < KT_OP_MAX_IN; k++)
            s->in[k] = kt__get_i32(r);
        for (int k = 0; k < KT_OP_MAX_OUT; k++)
            s->out[k] = kt__get_i32(r);
        for (int k = 0; k < KT_OP_MAX_OUT; k++)
            s->gout[k] = kt__get_i32(r);
        for (int k = 0; k < KT_OP_MAX_IN; k++)
            s->gin[k] = kt__get_i32(r);
        s->scratch = kt__get_i32(r);
        s->name = kt__get_i32(r);
        s->flags = kt__get_i32(r);
        s->node = -1;
        s->flops = kt__get_f64(r);
        if (s->n_in < 0 || s->n_in > KT_OP_MAX_IN || s->n_out < 0 || s->n_out > KT_OP_MAX_OUT)
            return kt__error(KT_EFORMAT, "program file: step %d has invalid counts", i);
    }
    for (int k = 0; k < 3; k++) {
        for (int32_t i = 0; i < p->n_entries[k]; i++) {
            kt__pentry *e = &p->entries[k][i];
            e->name = kt__get_i32(r);
            e->buf = kt__get_i32(r);
            e->grad_buf = kt__get_i32(r);
            e->init.kind = (kt_init_kind)kt__get_i32(r);
            e->init.a = kt__get_f32(r);
            e->init.b = kt__get_f32(r);
            e->shard_dim = kt__get_i32(r);
        }
    }
    return r->bad ? kt__error(KT_EFORMAT, "program file: truncated tables") : KT_OK;
}

kt_status kt_program_load_memory(const void *data, size_t size, kt_program **program_out)
{
    if (program_out != NULL)
        *program_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if ((data == NULL && size > 0) || program_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_load_memory: NULL argument");
    const unsigned char *bytes = data;
    if (size < 24 + 4 || memcmp(bytes, KTP_MAGIC, 8) != 0)
        return kt__error(KT_EFORMAT, "not a libkt program (bad magic or too short: %zu bytes)",
                         size);
    kt__reader r = {bytes, 8, size, 0};
    uint32_t version = kt__get_u32(&r);
    uint32_t flags = kt__get_u32(&r);
    uint64_t body = kt__get_u64(&r);
    if (version < KTP_OLDEST_VERSION || version > KTP_VERSION)
        return kt__error(KT_EFORMAT, "program file version %u, this libkt reads versions %u to %u",
                         version, KTP_OLDEST_VERSION, KTP_VERSION);
    if (flags != 0)
        return kt__error(KT_EFORMAT, "program file: unknown flags 0x%x", flags);
    if (body > size - 28 || 24 + body + 4 != size)
        return kt__error(KT_EFORMAT, "program file: %zu bytes, the header says %llu (truncated "
                         "or padded)", size, (unsigned long long)(24 + body + 4));
    uint32_t stored = (uint32_t)bytes[size - 4] | (uint32_t)bytes[size - 3] << 8 |
                      (uint32_t)bytes[size - 2] << 16 | (uint32_t)bytes[size - 1] << 24;
    if (kt__crc32(bytes, size - 4) != stored)
        return kt__error(KT_EFORMAT, "program file: checksum mismatch (the file is corrupt)");
    r.size = size - 4;

    kt_status status = KT_OK;
    kt_program *p = calloc(1, sizeof *p);
    if (p == NULL)
        return kt__error(KT_ENOMEM, "program load: out of memory");
    uint64_t strings_len = 0;
    if ((status = read_counts(&r, p, &strings_len)) != KT_OK)
        goto fail;
    p->bufs = calloc((size_t)p->n_bufs + 1, sizeof *p->bufs);
    p->steps = calloc((size_t)p->n_steps + 1, sizeof *p->steps);
    for (int k = 0; k < 3; k++)
        p->entries[k] = calloc((size_t)p->n_entries[k] + 1, sizeof *p->entries[k]);
    p->strings.data = malloc((size_t)strings_len + 1);
    if (!p->bufs || !p->steps || !p->entries[0] || !p->entries[1] || !p->entries[2] ||
        !p->strings.data) {
        status = kt__error(KT_ENOMEM, "program load: out of memory");
        goto fail;
    }
    if ((status = read_tables(&r, p)) != KT_OK)
        goto fail;
    const unsigned char *names = kt__get_bytes(&r, (size_t)strings_len);
    if (names == NULL || r.pos != r.size) {
        status = kt__error(KT_EFORMAT, "program file: the name pool does not end the body");
        goto fail;
    }
    memcpy(p->strings.data, names, (size_t)strings_len);
    p->strings.len = p->strings.cap = (size_t)strings_len;
    if ((status = kt__program_validate(p)) != KT_OK) {
        kt__error_context(status, "program file is inconsistent");
        goto fail;
    }
    *program_out = p;
    return KT_OK;
fail:
    kt__program_free(p);
    return status;
}

/* A program file holds tables of steps and buffers, no weights: far below this. The cap keeps
 * a wrong path (a device, a huge file) from making the loader allocate without bound. */
#define KTP_MAX_FILE ((uint64_t)1 << 30)
#define KTP_HEADER 24 /* magic, version, flags, body size */

/* A file whose size is unknown (a pipe, a device): the header says how long the program is,
 * so read that much and one byte more (which tells a padded file), never past the cap.
 * Whatever is wrong with the bytes read is left to kt_program_load_memory to say. */
static kt_status read_stream(int fd, const char *path, unsigned char **buf, size_t *len)
{
    size_t cap = 0;
    KT__TRY(kt__read_upto(fd, path, buf, len, &cap, KTP_HEADER));
    if (*len < KTP_HEADER || memcmp(*buf, KTP_MAGIC, 8) != 0)
        return KT_OK;
    kt__reader r = {*buf, 16, *len, 0};
    uint64_t body = kt__get_u64(&r);
    if (body > KTP_MAX_FILE - KTP_HEADER - 4)
        return kt__error(KT_EFORMAT,
                         "%s: the header declares a %llu-byte body, more than a "
                         "program file holds (at most %llu bytes in all)",
                         path, (unsigned long long)body, (unsigned long long)KTP_MAX_FILE);
    return kt__read_upto(fd, path, buf, len, &cap, (size_t)(KTP_HEADER + body + 4 + 1));
}

/* The whole file, read through its descriptor: a regular file by its size, anything else
 * (a pipe, as in kt-run <(...)) as a stream. A directory is refused by name. */
static kt_status read_file(int fd, const char *path, unsigned char **buf, size_t *len)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return kt__error(KT_EIO, "%s: cannot stat: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode))
        return kt__error(KT_EIO, "%s: cannot read: %s", path, strerror(EISDIR));
    if (!S_ISREG(st.st_mode))
        return read_stream(fd, path, buf, len);
    if ((uint64_t)st.st_size > KTP_MAX_FILE)
        return kt__error(KT_EFORMAT,
                         "%s: %llu bytes, more than a program file holds (at most %llu)", path,
                         (unsigned long long)st.st_size, (unsigned long long)KTP_MAX_FILE);
    size_t cap = 0;
    return kt__read_upto(fd, path, buf, len, &cap, (size_t)st.st_size);
}

kt_status kt_program_load(const char *path, kt_program **program_out)
{
    if (program_out != NULL)
        *program_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (path == NULL || program_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_load: NULL argument");
    int fd = -1;
    KT__TRY(kt_in_open(path, &fd, NULL));
    unsigned char *buf = NULL;
    size_t len = 0;
    kt_status status = read_file(fd, path, &buf, &len);
    close(fd);
    if (status == KT_OK) {
        status = kt_program_load_memory(buf, len, program_out);
        if (status != KT_OK)
            kt__error_context(status, "%s", path);
    }
    free(buf);
    return status;
}
