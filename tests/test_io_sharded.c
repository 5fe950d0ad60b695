/* Sharded checkpoints and converting reads: a checkpoint split over shards with an index reads
 * exactly as the one file does (by path, index or directory); every way an index and its
 * shards can disagree is refused with a message naming the file and the tensor; float dtypes
 * convert with one rounding to nearest even (bits checked); kt_session_load reads a sharded,
 * bf16 / f64 checkpoint into f32 parameters; transformers' own sharded and bf16 saves
 * (tests/hf/fixtures) read as their one-file f32 original does. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kt/io.h"
#include "kt/kt.h"
#include "tests/support/test_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */

/* dir/name in a static ring of buffers: enough for the few paths a check uses at once. */
static const char *at(const char *dir, const char *name)
{
    static char ring[8][512];
    static int next;
    char *p = ring[next++ % 8];
    int n = snprintf(p, sizeof ring[0], "%s/%s", dir, name);
    assert_true(n > 0 && (size_t)n < sizeof ring[0]);
    return p;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

/* A file of raw tensors in any of the format's dtypes: names[i] is dtypes[i] with counts[i]
 * elements of sizes[i] bytes from data[i] (1-D). */
typedef struct raw {
    const char *name, *dtype;
    int64_t count;
    size_t size;
    const void *data;
} raw;

static void write_raw(const char *path, const raw *r, int n)
{
    char header[4096];
    size_t len = 0, offset = 0;
    len += (size_t)snprintf(header + len, sizeof header - len, "{");
    for (int i = 0; i < n; i++) {
        size_t bytes = (size_t)r[i].count * r[i].size;
        len += (size_t)snprintf(header + len, sizeof header - len,
                                "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%zu,%zu]}",
                                i ? "," : "", r[i].name, r[i].dtype, (long long)r[i].count, offset,
                                offset + bytes);
        offset += bytes;
    }
    len += (size_t)snprintf(header + len, sizeof header - len, "}");
    assert_true(len < sizeof header);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    unsigned char prefix[8];
    for (int i = 0; i < 8; i++)
        prefix[i] = (unsigned char)((uint64_t)len >> (8 * i));
    assert_int_equal(fwrite(prefix, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, len, f), len);
    for (int i = 0; i < n; i++)
        assert_int_equal(fwrite(r[i].data, r[i].size, (size_t)r[i].count, f), (size_t)r[i].count);
    assert_int_equal(fclose(f), 0);
}

static uint32_t bits32(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* ---- a checkpoint, whole and in shards -------------------------------------------------------- */

enum { N_TENSORS = 6 };

typedef struct checkpoint {
    kt_st_item items[N_TENSORS];
} checkpoint;

static const char *const tensor_names[N_TENSORS] = {
    "model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight", "position_ids"};

static void make_checkpoint(checkpoint *c)
{
    static const kt_dtype dtypes[N_TENSORS] = {KT_F32, KT_BF16, KT_F32, KT_F16, KT_F32, KT_I64};
    static const int64_t shapes[N_TENSORS][2] = {{7, 3}, {4, 5}, {3, 0}, {2, 6}, {3, 0}, {5, 0}};
    tu_rng rng;
    tu_rng_seed(&rng, 11);
    for (int i = 0; i < N_TENSORS; i++) {
        int ndim = shapes[i][1] ? 2 : 1;
        c->items[i].name = tensor_names[i];
        c->items[i].tensor = tu_alloc(dtypes[i], ndim, shapes[i]);
        tu_fill_uniform(&c->items[i].tensor, &rng, -4, 4);
    }
}

static void free_checkpoint(checkpoint *c)
{
    for (int i = 0; i < N_TENSORS; i++)
        tu_free(&c->items[i].tensor);
}

static const char *const shard1 = "model-00001-of-00002.safetensors";
static const char *const shard2 = "model-00002-of-00002.safetensors";

/* The index of the two-shard split below: tensors 0, 2, 1 (in that header order) in shard 1,
 * 5, 3, 4 in shard 2. */
static const char two_shard_index[] =
    "{\n  \"metadata\": {\"total_size\": 1234, \"note\": \"split\", \"nested\": {\"a\": 1}},\n"
    "  \"weight_map\": {\n"
    "    \"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\",\n"
    "    \"model.layers.0.input_layernorm.weight\": \"model-00001-of-00002.safetensors\",\n"
    "    \"model.layers.0.mlp.gate_proj.weight\": \"model-00001-of-00002.safetensors\",\n"
    "    \"model.layers.1.self_attn.q_proj.weight\": \"model-00002-of-00002.safetensors\",\n"
    "    \"model.norm.weight\": \"model-00002-of-00002.safetensors\",\n"
    "    \"position_ids\": \"model-00002-of-00002.safetensors\"\n  }\n}\n";

static void write_sharded(const char *dir, const checkpoint *c)
{
    static const char *const meta1[] = {"format", "pt", "shard", "1", NULL};
    static const char *const meta2[] = {"format", "pt", "shard", "2", NULL};
    kt_st_item a[3] = {c->items[0], c->items[2], c->items[1]};
    kt_st_item b[3] = {c->items[5], c->items[3], c->items[4]};
    OK(kt_st_save(at(dir, shard2), b, 3, meta2)); /* written first: order comes from names */
    OK(kt_st_save(at(dir, shard1), a, 3, meta1));
    write_text(at(dir, "model.safetensors.index.json"), two_shard_index);
}

/* f reads every tensor of c, bitwise, through find and read. */
static void expect_same_tensors(const kt_st_file *f, const checkpoint *c)
{
    assert_int_equal(kt_st_count(f), N_TENSORS);
    for (int i = 0; i < N_TENSORS; i++) {
        const kt_tensor *want = &c->items[i].tensor;
        kt_tensor view;
        OK(kt_st_find(f, tensor_names[i], &view));
        assert_int_equal(view.dtype, want->dtype);
        assert_true(kt_tensor_same_shape(&view, want));
        assert_memory_equal(view.data, want->data, kt_tensor_nbytes(want) ? kt_tensor_nbytes(want) : 1);
        kt_tensor got = tu_alloc(want->dtype, want->ndim, want->shape);
        OK(kt_st_read(f, tensor_names[i], &got));
        assert_true(tu_bitwise_equal(&got, want));
        /* a view stays good after the read gave its pages back */
        assert_memory_equal(view.data, want->data, kt_tensor_nbytes(want) ? kt_tensor_nbytes(want) : 1);
        tu_free(&got);
    }
}

static void test_sharded_equals_single(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_sharded_test");
    const char *single = at(dir, "single"), *sharded = at(dir, "sharded");
    char single_dir[512], sharded_dir[512];
    strcpy(single_dir, single);
    strcpy(sharded_dir, sharded);
    assert_int_equal(mkdir(single_dir, 0700), 0);
    assert_int_equal(mkdir(sharded_dir, 0700), 0);
    checkpoint c;
    make_checkpoint(&c);
    static const char *const meta[] = {"format", "pt", NULL};
    OK(kt_st_save(at(single_dir, "model.safetensors"), c.items, N_TENSORS, meta));
    write_sharded(sharded_dir, &c);

    /* the one file: by path and by its directory */
    const char *single_paths[2] = {at(single_dir, "model.safetensors"), single_dir};
    for (int k = 0; k < 2; k++) {
        kt_st_file *f = NULL;
        OK(kt_st_open(single_paths[k], &f));
        expect_same_tensors(f, &c);
        assert_int_equal(kt_st_is_sharded(f), 0);
        assert_int_equal(kt_st_shard_count(f), 1);
        assert_string_equal(kt_st_shard_name(f, 0), "model.safetensors");
        assert_string_equal(kt_st_shard_path(f, 0), at(single_dir, "model.safetensors"));
        assert_string_equal(kt_st_entry_file(f, 3), "model.safetensors");
        assert_string_equal(kt_st_metadata(f, "format"), "pt");
        kt_st_close(f);
    }

    /* the shards: by index and by directory (with and without a trailing slash) */
    char slash[600];
    snprintf(slash, sizeof slash, "%s/", sharded_dir);
    const char *sharded_paths[3] = {at(sharded_dir, "model.safetensors.index.json"), sharded_dir,
                                    slash};
    static const int order[N_TENSORS] = {0, 2, 1, 5, 3, 4}; /* shard 1's header, then 2's */
    for (int k = 0; k < 3; k++) {
        kt_st_file *f = NULL;
        OK(kt_st_open(sharded_paths[k], &f));
        expect_same_tensors(f, &c);
        assert_int_equal(kt_st_is_sharded(f), 1);
        assert_int_equal(kt_st_shard_count(f), 2);
        assert_string_equal(kt_st_shard_name(f, 0), shard1);
        assert_string_equal(kt_st_shard_name(f, 1), shard2);
        assert_null(kt_st_shard_name(f, 2));
        assert_null(kt_st_shard_path(f, 2));
        assert_non_null(strstr(kt_st_shard_path(f, 1), shard2));
        for (int i = 0; i < N_TENSORS; i++) {
            const char *name = NULL;
            kt_st_info info;
            size_t pos;
            OK(kt_st_entry(f, (size_t)i, &name, NULL));
            assert_string_equal(name, tensor_names[order[i]]);
            OK(kt_st_entry_info(f, (size_t)i, &info));
            assert_string_equal(info.name, name);
            assert_int_equal(info.shard, i < 3 ? 0 : 1);
            assert_int_equal(info.nbytes, kt_tensor_nbytes(&c.items[order[i]].tensor));
            assert_int_equal(info.dtype, c.items[order[i]].tensor.dtype);
            /* file_offset: the tensor's bytes, read straight from its shard's file */
            unsigned char from_file[256];
            assert_true(info.nbytes <= sizeof from_file);
            FILE *shard_file = fopen(kt_st_shard_path(f, info.shard), "rb");
            assert_non_null(shard_file);
            assert_int_equal(fseek(shard_file, (long)info.file_offset, SEEK_SET), 0);
            assert_int_equal(fread(from_file, 1, info.nbytes, shard_file), info.nbytes);
            fclose(shard_file);
            assert_memory_equal(from_file, c.items[order[i]].tensor.data, info.nbytes);
            assert_string_equal(kt_st_entry_file(f, (size_t)i), i < 3 ? shard1 : shard2);
            OK(kt_st_lookup(f, name, &pos));
            assert_int_equal(pos, i);
        }
        assert_null(kt_st_entry_file(f, N_TENSORS));
        /* the index's metadata first (integers as text), then the shards' in shard order */
        assert_string_equal(kt_st_metadata(f, "total_size"), "1234");
        assert_string_equal(kt_st_metadata(f, "note"), "split");
        assert_null(kt_st_metadata(f, "nested"));
        assert_string_equal(kt_st_metadata(f, "format"), "pt");
        assert_string_equal(kt_st_metadata(f, "shard"), "1");
        assert_null(kt_st_metadata(f, "absent"));
        size_t pos;
        TU_EXPECT_ERROR(kt_st_lookup(f, "nope", &pos), KT_EINVAL, "no tensor named 'nope'");
        kt_tensor view;
        TU_EXPECT_ERROR(kt_st_find(f, "nope", &view), KT_EINVAL, "model.safetensors.index.json",
                        "no tensor named 'nope'");
        kt_st_close(f);
    }

    /* a directory with both: the index wins */
    OK(kt_st_save(at(sharded_dir, "model.safetensors"), c.items, 1, NULL));
    kt_st_file *f = NULL;
    OK(kt_st_open(sharded_dir, &f));
    assert_int_equal(kt_st_count(f), N_TENSORS);
    assert_int_equal(kt_st_is_sharded(f), 1);
    kt_st_close(f);

    /* shards in a subdirectory of the index's */
    char sub[600];
    snprintf(sub, sizeof sub, "%s/parts", sharded_dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    OK(kt_st_save(at(sub, "one.safetensors"), c.items, 2, NULL));
    write_text(at(sharded_dir, "parts.index.json"),
               "{\"weight_map\": {\"model.embed_tokens.weight\": \"parts/one.safetensors\", "
               "\"model.layers.0.mlp.gate_proj.weight\": \"./parts/one.safetensors\"}}");
    /* the same file under two names is a tensor in two shards */
    TU_EXPECT_ERROR(kt_st_open(at(sharded_dir, "parts.index.json"), &f), KT_EFORMAT,
                    "parts.index.json", "is in two shards");
    write_text(at(sharded_dir, "parts.index.json"),
               "{\"weight_map\": {\"model.embed_tokens.weight\": \"parts/one.safetensors\", "
               "\"model.layers.0.mlp.gate_proj.weight\": \"parts/one.safetensors\"}}");
    OK(kt_st_open(at(sharded_dir, "parts.index.json"), &f));
    assert_int_equal(kt_st_count(f), 2);
    assert_string_equal(kt_st_entry_file(f, 0), "parts/one.safetensors");
    kt_st_close(f);

    /* an empty directory names both files it looked for */
    char empty[600];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    assert_int_equal(mkdir(empty, 0700), 0);
    TU_EXPECT_ERROR(kt_st_open(empty, &f), KT_EIO, empty, "model.safetensors.index.json",
                    "or model.safetensors");
    assert_null(f);

    free_checkpoint(&c);
    tu_remove_tree(dir);
    free(dir);
}

/* ---- every way an index and its shards can be wrong ------------------------------------------ */

/* Writes `index` as dir/bad.index.json, expects kt_st_open to fail with `status` and every
 * fragment in the message (which always names the index), and *f to stay NULL. */
#define EXPECT_INDEX_ERROR(dir, index, status, ...)                                              \
    do {                                                                                         \
        const char *p_ = at(dir, "bad.index.json");                                              \
        write_text(p_, index);                                                                   \
        kt_st_file *f_ = (kt_st_file *)1;                                                        \
        TU_EXPECT_ERROR(kt_st_open(p_, &f_), status, "bad.index.json", __VA_ARGS__);            \
        assert_null(f_);                                                                         \
    } while (0)

#define MAP3(x, y, z)                                                                            \
    "{\"weight_map\": {\"x\": \"" x "\", \"y\": \"" y "\", \"z\": \"" z "\"}}"

static void test_index_errors(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_sharded_test");
    float xs[2] = {1, 2}, ys[3] = {3, 4, 5}, zs[1] = {6};
    kt_st_item a[2] = {{"x", {0}}, {"y", {0}}}, b[1] = {{"z", {0}}}, dup[2] = {{"z", {0}},
                                                                                 {"x", {0}}};
    kt_tensor_init(&a[0].tensor, xs, KT_F32, 1, (int64_t[]){2});
    kt_tensor_init(&a[1].tensor, ys, KT_F32, 1, (int64_t[]){3});
    kt_tensor_init(&b[0].tensor, zs, KT_F32, 1, (int64_t[]){1});
    dup[0].tensor = b[0].tensor;
    dup[1].tensor = a[0].tensor;
    OK(kt_st_save(at(dir, "a.safetensors"), a, 2, NULL));
    OK(kt_st_save(at(dir, "b.safetensors"), b, 1, NULL));
    OK(kt_st_save(at(dir, "dup.safetensors"), dup, 2, NULL));
    kt_st_file *f = NULL;
    write_text(at(dir, "good.index.json"), MAP3("a.safetensors", "a.safetensors", "b.safetensors"));
    OK(kt_st_open(at(dir, "good.index.json"), &f));
    assert_int_equal(kt_st_count(f), 3);
    kt_st_close(f);

    /* the index itself */
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": ", KT_EFORMAT, "the index is not JSON");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": 0.5}}", KT_EFORMAT, "not JSON");
    EXPECT_INDEX_ERROR(dir, "", KT_EFORMAT, "not JSON");
    EXPECT_INDEX_ERROR(dir, "[1, 2]", KT_EFORMAT, "the index is a JSON array, not an object");
    EXPECT_INDEX_ERROR(dir, "{\"metadata\": {\"total_size\": 4}}", KT_EFORMAT,
                       "no \"weight_map\"");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": [\"a.safetensors\"]}", KT_EFORMAT,
                       "\"weight_map\" is a JSON array, not an object");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {}, \"weight_map\": {}}", KT_EFORMAT,
                       "\"weight_map\" appears twice");
    EXPECT_INDEX_ERROR(dir, "{\"metadata\": 3, \"weight_map\": {}}", KT_EFORMAT,
                       "\"metadata\" is a JSON integer, not an object");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": 3}}", KT_EFORMAT, "tensor 'x'",
                       "its shard is a JSON integer, not a string");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": \"\"}}", KT_EFORMAT, "tensor 'x'",
                       "empty");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": \"a.safetensors\", \"x\": \"a.safetensors\"}}",
                       KT_EFORMAT, "tensor 'x' appears twice in \"weight_map\"");
    /* shard names that leave the directory */
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "../a.safetensors", "b.safetensors"), KT_EFORMAT,
                       "tensor 'y'", "shard '../a.safetensors' leaves the index's directory");
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "sub/../../b.safetensors"),
                       KT_EFORMAT, "tensor 'z'", "leaves the index's directory");
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", ".."), KT_EFORMAT,
                       "leaves the index's directory");
    EXPECT_INDEX_ERROR(dir, MAP3("/etc/a.safetensors", "a.safetensors", "b.safetensors"),
                       KT_EFORMAT, "tensor 'x'", "is an absolute path");

    /* the shards: missing, unreadable, truncated, corrupt */
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "gone.safetensors"), KT_EIO,
                       "shard 'gone.safetensors'", "gone.safetensors: cannot open",
                       "No such file or directory");
    assert_int_equal(mkdir(at(dir, "d.safetensors"), 0700), 0);
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "d.safetensors"), KT_EIO,
                       "shard 'd.safetensors'", "Is a directory");
    OK(kt_st_save(at(dir, "locked.safetensors"), b, 1, NULL));
    assert_int_equal(chmod(at(dir, "locked.safetensors"), 0), 0);
    if (geteuid() != 0)
        EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "locked.safetensors"),
                           KT_EIO, "shard 'locked.safetensors'", "Permission denied");
    else
        printf("(skipped the unreadable-shard case: root reads a file of mode 0)\n");
    OK(kt_st_save(at(dir, "cut.safetensors"), b, 1, NULL));
    struct stat st;
    assert_int_equal(stat(at(dir, "cut.safetensors"), &st), 0);
    assert_int_equal(truncate(at(dir, "cut.safetensors"), st.st_size - 2), 0);
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "cut.safetensors"), KT_EFORMAT,
                       "shard 'cut.safetensors'", "tensor 'z'", "extend past the");
    FILE *junk = fopen(at(dir, "junk.safetensors"), "wb"); /* a header cut off mid-object */
    assert_non_null(junk);
    assert_int_equal(fwrite("\x05\0\0\0\0\0\0\0{\"z\":", 1, 13, junk), 13);
    assert_int_equal(fclose(junk), 0);
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "junk.safetensors"), KT_EFORMAT,
                       "shard 'junk.safetensors'", "junk.safetensors: header");

    /* the index and the shards disagree */
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "a.safetensors"), KT_EFORMAT,
                       "tensor 'z'", "maps it to shard 'a.safetensors', which does not hold it");
    EXPECT_INDEX_ERROR(dir, "{\"weight_map\": {\"x\": \"a.safetensors\", \"z\": \"b.safetensors\"}}",
                       KT_EFORMAT, "tensor 'y' is in", "a.safetensors",
                       "but the index does not list it");
    EXPECT_INDEX_ERROR(dir, MAP3("b.safetensors", "a.safetensors", "b.safetensors"), KT_EFORMAT,
                       "tensor 'x'", "maps it to shard 'b.safetensors' but it is in",
                       "a.safetensors");
    EXPECT_INDEX_ERROR(dir, MAP3("a.safetensors", "a.safetensors", "dup.safetensors"), KT_EFORMAT,
                       "tensor 'x' is in two shards", "a.safetensors", "dup.safetensors");

    /* an index that is no file */
    TU_EXPECT_ERROR(kt_st_open(at(dir, "absent.index.json"), &f), KT_EIO, "absent.index.json",
                    "No such file");
    assert_null(f);
    tu_remove_tree(dir);
    free(dir);
}

/* ---- float conversion, bit for bit ------------------------------------------------------------ */

/* Reads `name` converted into a fresh tensor of `dtype` and n elements. */
static kt_tensor read_as(const kt_st_file *f, const char *name, kt_dtype dtype, int64_t n)
{
    kt_tensor t = tu_alloc(dtype, 1, (int64_t[]){n});
    OK(kt_st_check_convert(f, name, &t));
    OK(kt_st_read_convert(f, name, &t));
    return t;
}

static void expect_u16(const kt_tensor *t, const uint16_t *want, int n, const char *what)
{
    const uint16_t *got = t->data;
    for (int i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s[%d]: 0x%04x, expected 0x%04x", what, i, got[i], want[i]);
}

static void expect_u32(const kt_tensor *t, const uint32_t *want, int n, const char *what)
{
    const float *got = t->data;
    for (int i = 0; i < n; i++)
        if (bits32(got[i]) != want[i])
            fail_msg("%s[%d]: 0x%08x, expected 0x%08x", what, i, bits32(got[i]), want[i]);
}

static void test_convert_values(void **state)
{
    (void)state;
    /* bf16 -> f32: exact (a shift; NaN payloads kept) */
    static const uint16_t bf16_in[6] = {0x3f80, 0xc049, 0x0001, 0x7f80, 0x7fc1, 0x8000};
    /* f32 -> bf16: ties to even, above a tie up, overflow to inf, NaN made quiet */
    static const uint32_t f32_in[10] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f80ffffu,
                                        0x7f7fffffu, 0x00000001u, 0x80008000u, 0x7fa00000u,
                                        0x3f801000u, 0x3f803000u};
    static const uint16_t f32_to_bf16[10] = {0x3f80, 0x3f82, 0x3f81, 0x3f81, 0x7f80,
                                             0x0000, 0x8000, 0x7fe0, 0x3f80, 0x3f80};
    /* ... and to f16: the last two are 1 + 2^-11 (tie, even: 1) and 1 + 3 * 2^-11 (tie, odd:
     * up) */
    static const uint16_t f32_to_f16[10] = {0x3c04, 0x3c0c, 0x3c04, 0x3c08, 0x7c00,
                                            0x0000, 0x8000, 0x7f00, 0x3c00, 0x3c02};
    static const uint16_t f16_in[4] = {0x3c00, 0x0001, 0x7c00, 0xfbff};
    static const uint32_t f16_to_f32[4] = {0x3f800000u, 0x33800000u, 0x7f800000u, 0xc77fe000u};
    const double p8 = ldexp(1, -8), p24 = ldexp(1, -24), p11 = ldexp(1, -11);
    const double f64_in[12] = {0.1,
                               1 + p24,                    /* tie: even, 1 */
                               1 + p24 + ldexp(1, -40),    /* above the tie: up */
                               1 + 3 * p24,                /* tie, odd: up */
                               1e300,
                               -1e-300,
                               NAN,
                               3.0,
                               1 + p8 + ldexp(1, -30),     /* bf16: rounding twice would tie */
                               1 + p8,
                               1 + p11 + ldexp(1, -40),    /* f16: rounding twice would tie */
                               -65520.0};
    static const uint32_t f64_to_f32[12] = {0x3dcccccdu, 0x3f800000u, 0x3f800001u, 0x3f800002u,
                                            0x7f800000u, 0x80000000u, 0,           0x40400000u,
                                            0x3f808000u, 0x3f808000u, 0x3f801000u, 0xc77ff000u};
    static const uint16_t f64_to_bf16[12] = {0x3dcd, 0x3f80, 0x3f80, 0x3f80, 0x7f80, 0x8000,
                                             0x7fc0, 0x4040, 0x3f81, 0x3f80, 0x3f80, 0xc780};
    static const uint16_t f64_to_f16[12] = {0x2e66, 0x3c00, 0x3c00, 0x3c00, 0x7c00, 0x8000,
                                            0x7e00, 0x4200, 0x3c04, 0x3c04, 0x3c01, 0xfc00};
    static const uint16_t bf16_pair[2] = {0x3f81, 0x4780}; /* 1 + 2^-7, 65536 */
    static const uint16_t f16_pair[2] = {0x3c06, 0x3c0c};  /* 1 + 6 * 2^-10, 1 + 3 * 2^-8 */
    int64_t ids[2] = {1, 2};
    uint8_t fp8[2] = {0x38, 0x40};
    char *dir = tu_temp_dir("kt_sharded_test");
    const char *path = at(dir, "mixed.safetensors");
    char p[512];
    strcpy(p, path);
    raw r[8] = {{"bf16", "BF16", 6, 2, bf16_in},   {"f32", "F32", 10, 4, f32_in},
                {"f16", "F16", 4, 2, f16_in},      {"f64", "F64", 12, 8, f64_in},
                {"bf16_pair", "BF16", 2, 2, bf16_pair}, {"f16_pair", "F16", 2, 2, f16_pair},
                {"ids", "I64", 2, 8, ids},         {"fp8", "F8_E4M3", 2, 1, fp8}};
    write_raw(p, r, 8);
    kt_st_file *f = NULL;
    OK(kt_st_open(p, &f));

    kt_tensor t = read_as(f, "bf16", KT_F32, 6);
    const float *tf = t.data;
    for (int i = 0; i < 6; i++)
        assert_int_equal(bits32(tf[i]), (uint32_t)bf16_in[i] << 16);
    tu_free(&t);
    t = read_as(f, "f32", KT_BF16, 10);
    expect_u16(&t, f32_to_bf16, 10, "f32 -> bf16");
    tu_free(&t);
    t = read_as(f, "f32", KT_F16, 10);
    expect_u16(&t, f32_to_f16, 10, "f32 -> f16");
    tu_free(&t);
    t = read_as(f, "f16", KT_F32, 4);
    expect_u32(&t, f16_to_f32, 4, "f16 -> f32");
    tu_free(&t);
    t = read_as(f, "f64", KT_F32, 12);
    tf = t.data;
    assert_true(isnan(tf[6]));
    tf = NULL;
    ((float *)t.data)[6] = float_of(0);
    expect_u32(&t, f64_to_f32, 12, "f64 -> f32");
    tu_free(&t);
    t = read_as(f, "f64", KT_BF16, 12);
    expect_u16(&t, f64_to_bf16, 12, "f64 -> bf16");
    tu_free(&t);
    t = read_as(f, "f64", KT_F16, 12);
    expect_u16(&t, f64_to_f16, 12, "f64 -> f16");
    tu_free(&t);
    /* between the 16-bit dtypes: one rounding, through the exact f32 */
    t = read_as(f, "bf16_pair", KT_F16, 2);
    expect_u16(&t, (const uint16_t[]){0x3c08, 0x7c00}, 2, "bf16 -> f16");
    tu_free(&t);
    t = read_as(f, "f16_pair", KT_BF16, 2);
    expect_u16(&t, (const uint16_t[]){0x3f81, 0x3f82}, 2, "f16 -> bf16"); /* up; a tie, odd */
    tu_free(&t);
    /* the same dtype is a copy, any dtype */
    t = read_as(f, "ids", KT_I64, 2);
    assert_int_equal(((int64_t *)t.data)[1], 2);
    tu_free(&t);
    t = read_as(f, "f16", KT_F16, 4);
    expect_u16(&t, f16_in, 4, "f16 -> f16");
    tu_free(&t);

    /* what does not convert: both dtypes named, with the file and the tensor */
    kt_tensor d = tu_new(KT_F32, 2);
    TU_EXPECT_ERROR(kt_st_read_convert(f, "ids", &d), KT_EUNSUPPORTED, p, "tensor 'ids'",
                    "I64", "does not convert to f32");
    TU_EXPECT_ERROR(kt_st_check_convert(f, "ids", &d), KT_EUNSUPPORTED, "I64", "f32");
    tu_free(&d);
    d = tu_new(KT_BF16, 2);
    TU_EXPECT_ERROR(kt_st_read_convert(f, "fp8", &d), KT_EUNSUPPORTED, p, "tensor 'fp8'",
                    "F8_E4M3", "bf16");
    tu_free(&d);
    d = tu_new(KT_I32, 10);
    TU_EXPECT_ERROR(kt_st_read_convert(f, "f32", &d), KT_EUNSUPPORTED, "tensor 'f32'", "F32",
                    "i32");
    tu_free(&d);
    d = tu_new(KT_F32, 3, 4);
    TU_EXPECT_ERROR(kt_st_read_convert(f, "f64", &d), KT_EINVAL, "tensor 'f64'", "F64[12]",
                    "f32[3,4]");
    tu_free(&d);
    d = tu_new(KT_F32, 12);
    kt_tensor tr;
    kt_tensor_init(&tr, NULL, KT_F32, 1, (int64_t[]){12}); /* a shape alone checks */
    OK(kt_st_check_convert(f, "f64", &tr));
    TU_EXPECT_ERROR(kt_st_read_convert(f, "f64", &tr), KT_EINVAL, "has no data");
    TU_EXPECT_ERROR(kt_st_read_convert(f, "absent", &d), KT_EINVAL, "no tensor named 'absent'");
    TU_EXPECT_ERROR(kt_st_read(f, "f64", &d), KT_EINVAL, "F64[12]", "f32[12]");
    tu_free(&d);
    TU_EXPECT_ERROR(kt_st_read_convert(NULL, "x", &d), KT_EINVAL, "NULL");
    kt_st_close(f);
    tu_remove_tree(dir);
    free(dir);
}

/* ---- kt_session_load from a sharded, converted checkpoint ------------------------------------- */

static const char model_text[] = "input x: f32[2, 8]\n"
                                 "param w: f32[8, 4] = zeros\n"
                                 "param b: f32[4] = zeros\n"
                                 "h = matmul(x, w)\n"
                                 "h = add(h, b)\n"
                                 "output h\n";

static kt_session *model_session(kt_program **p_out)
{
    kt_program *p = tu_compile_ktg(model_text, "model.ktg", 0);
    kt_session *s = NULL;
    kt_session_options so = {.threads = 1, .seed = 3};
    OK(kt_session_create(p, &so, &s));
    *p_out = p;
    return s;
}

static void test_session_load_sharded(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_sharded_test");
    uint16_t w[32];
    double b[4] = {0.1, -2.5, 1e-3, 7.0};
    for (int i = 0; i < 32; i++)
        w[i] = (uint16_t)(0x3f80 + 3 * i); /* bf16 values from 1 up */
    raw rb = {"b", "F64", 4, 8, b}; /* F64 has no kt_dtype: written by hand */
    write_raw(at(dir, "model-00002-of-00002.safetensors"), &rb, 1);
    kt_tensor wt;
    kt_tensor_init(&wt, w, KT_BF16, 2, (int64_t[]){8, 4});
    kt_st_item wi = {"w", wt};
    OK(kt_st_save(at(dir, "model-00001-of-00002.safetensors"), &wi, 1, NULL));
    write_text(at(dir, "model.safetensors.index.json"),
               "{\"metadata\": {\"total_size\": 96}, \"weight_map\": {"
               "\"w\": \"model-00001-of-00002.safetensors\", "
               "\"b\": \"model-00002-of-00002.safetensors\"}}");
    kt_program *p;
    kt_session *s = model_session(&p);
    OK(kt_session_load(s, dir, 0));
    kt_tensor sw, sb;
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "w", &sw));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "b", &sb));
    const float *fw = sw.data, *fb = sb.data;
    for (int i = 0; i < 32; i++)
        assert_int_equal(bits32(fw[i]), (uint32_t)w[i] << 16);
    for (int i = 0; i < 4; i++)
        assert_int_equal(bits32(fb[i]), bits32((float)b[i]));

    /* an integer where the program has a float: refused, naming the shard, the tensor and
     * both dtypes, and nothing changes */
    int64_t bi[4] = {1, 2, 3, 4};
    raw rbi = {"b", "I64", 4, 8, bi};
    write_raw(at(dir, "model-00002-of-00002.safetensors"), &rbi, 1);
    kt_tensor before = tu_clone(&sw);
    TU_EXPECT_ERROR(kt_session_load(s, dir, 0), KT_EUNSUPPORTED,
                    "model-00002-of-00002.safetensors", "tensor 'b'", "I64", "f32");
    assert_true(tu_bitwise_equal(&before, &sw));
    tu_free(&before);
    /* a shard missing: the session's load names it */
    assert_int_equal(unlink(at(dir, "model-00002-of-00002.safetensors")), 0);
    TU_EXPECT_ERROR(kt_session_load(s, dir, 0), KT_EIO, "model-00002-of-00002.safetensors",
                    "No such file");
    kt_session_destroy(s);
    kt_program_destroy(p);
    tu_remove_tree(dir);
    free(dir);
}

/* ---- transformers' own files (tests/hf/fixtures, written by save_pretrained) ----------------- */

static void test_hf_fixtures(void **state)
{
    (void)state;
    const char *root = KT_SOURCE_DIR "/tests/hf/fixtures";
    struct stat st;
    if (stat(at(root, "mixtral_sharded/model.safetensors.index.json"), &st) != 0)
        fail_msg("no %s/mixtral_sharded (committed; tests/hf/make_fixtures.py writes it)", root);
    /* the sharded save opens by its directory and equals the one-file save, bit for bit */
    kt_st_file *one = NULL, *sharded = NULL;
    OK(kt_st_open(at(root, "mixtral/model.safetensors"), &one));
    OK(kt_st_open(at(root, "mixtral_sharded"), &sharded));
    assert_int_equal(kt_st_is_sharded(sharded), 1);
    assert_true(kt_st_shard_count(sharded) >= 2);
    assert_int_equal(kt_st_count(sharded), kt_st_count(one));
    uint64_t total = 0;
    for (size_t i = 0; i < kt_st_count(one); i++) {
        const char *name = NULL;
        kt_tensor a, b;
        OK(kt_st_entry(one, i, &name, &a));
        OK(kt_st_find(sharded, name, &b));
        assert_int_equal(a.dtype, b.dtype);
        assert_true(kt_tensor_same_shape(&a, &b));
        assert_memory_equal(a.data, b.data, kt_tensor_nbytes(&a));
        total += kt_tensor_nbytes(&a);
    }
    char want[32];
    snprintf(want, sizeof want, "%llu", (unsigned long long)total);
    assert_string_equal(kt_st_metadata(sharded, "total_size"), want);
    kt_st_close(one);
    kt_st_close(sharded);

    /* transformers' bf16 save of the f32 model: libkt's f32 -> bf16 gives the same bits, and
     * bf16 -> f32 -> bf16 is the identity */
    kt_st_file *f32 = NULL, *bf16 = NULL;
    OK(kt_st_open(at(root, "qwen3_moe"), &f32));
    OK(kt_st_open(at(root, "qwen3_moe_bf16"), &bf16));
    int compared = 0;
    for (size_t i = 0; i < kt_st_count(bf16); i++) {
        const char *name = NULL;
        kt_tensor v, w;
        OK(kt_st_entry(bf16, i, &name, &v));
        if (v.dtype != KT_BF16 || kt_st_find(f32, name, &w) != KT_OK || w.dtype != KT_F32)
            continue;
        kt_tensor down = tu_alloc(KT_BF16, v.ndim, v.shape), up = tu_alloc(KT_F32, v.ndim, v.shape);
        OK(kt_st_read_convert(f32, name, &down));
        assert_memory_equal(down.data, v.data, kt_tensor_nbytes(&v));
        OK(kt_st_read_convert(bf16, name, &up));
        OK(kt_st_check_convert(bf16, name, &down));
        kt_tensor again = tu_convert(&up, KT_BF16);
        assert_memory_equal(again.data, v.data, kt_tensor_nbytes(&v));
        tu_free(&again);
        tu_free(&down);
        tu_free(&up);
        compared++;
    }
    assert_true(compared > 10);
    printf("mixtral_sharded equals mixtral; %d bf16 tensors of qwen3_moe_bf16 equal libkt's "
           "rounding of qwen3_moe's f32\n", compared);
    kt_st_close(f32);
    kt_st_close(bf16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharded_equals_single),
        cmocka_unit_test(test_index_errors),
        cmocka_unit_test(test_convert_values),
        cmocka_unit_test(test_session_load_sharded),
        cmocka_unit_test(test_hf_fixtures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
