/* safetensors: round trips through memory and files, the writer's exact bytes, the JSON
 * parser, every class of malformed header, truncation, random corruption, and bad calls. */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "lib/io/json.h"
#include "kt/io.h"
#include "tests/support/test_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */

/* An image of 8-byte length + header + data_len zero bytes, in a buffer of exactly that size
 * so that ASan catches any read past the end. */
static unsigned char *make_image(const char *header, size_t data_len, size_t *size_out)
{
    size_t h = strlen(header), size = 8 + h + data_len;
    unsigned char *img = calloc(1, size);
    assert_non_null(img);
    for (int i = 0; i < 8; i++)
        img[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(img + 8, header, h);
    *size_out = size;
    return img;
}

/* Opens a header over data_len bytes of data as "bad.st"; closes it again on success. */
static kt_status open_header(const char *header, size_t data_len)
{
    size_t size;
    unsigned char *img = make_image(header, data_len, &size);
    kt_st_file *f = NULL;
    kt_status s = kt_st_open_memory(img, size, "bad.st", &f);
    kt_st_close(f);
    free(img);
    return s;
}

static int count_dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            n++;
    closedir(d);
    return n;
}

static char *join(const char *dir, const char *name)
{
    char *p = malloc(strlen(dir) + strlen(name) + 2);
    assert_non_null(p);
    sprintf(p, "%s/%s", dir, name);
    return p;
}

static void remove_dir(char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char *p = join(dir, e->d_name);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISDIR(st.st_mode))
            rmdir(p);
        else
            unlink(p);
        free(p);
    }
    closedir(d);
    assert_int_equal(rmdir(dir), 0);
    free(dir);
}

/* ---- a set of tensors: every dtype at ranks 0..4, plus zero-size ones --------------------- */

#define N_DTYPES 5
#define N_SET (N_DTYPES * 5 + 3)

typedef struct tensor_set {
    kt_st_item items[N_SET];
    char names[N_SET][32];
} tensor_set;

static const char *const set_metadata[] = {"format", "pt", "note", "caf\xc3\xa9 \"quoted\"\n",
                                           "empty",  "",   NULL};

static void make_set(tensor_set *ts, uint64_t seed)
{
    static const int64_t dims[KT_MAX_DIMS] = {3, 2, 5, 4};
    static const int64_t zero_shapes[3][3] = {{0, 0, 0}, {4, 0, 0}, {2, 3, 0}};
    static const int zero_ndims[3] = {1, 2, 3};
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    size_t k = 0;
    for (int d = 0; d < N_DTYPES; d++) {
        for (int rank = 0; rank <= KT_MAX_DIMS; rank++, k++) {
            ts->items[k].tensor = tu_alloc((kt_dtype)d, rank, dims);
            tu_fill_uniform(&ts->items[k].tensor, &rng, -100, 100);
            snprintf(ts->names[k], sizeof ts->names[k], "%s.rank%d", kt_dtype_name((kt_dtype)d),
                     rank);
            ts->items[k].name = ts->names[k];
        }
    }
    for (int z = 0; z < 3; z++, k++) {
        ts->items[k].tensor = tu_alloc((kt_dtype)(z % N_DTYPES), zero_ndims[z], zero_shapes[z]);
        snprintf(ts->names[k], sizeof ts->names[k], "zero/%d", z);
        ts->items[k].name = ts->names[k];
    }
}

static void free_set(tensor_set *ts)
{
    for (size_t i = 0; i < N_SET; i++)
        tu_free(&ts->items[i].tensor);
}

/* The file holds exactly the set, in order, with the set's metadata. */
static void check_set(const kt_st_file *f, const tensor_set *ts)
{
    assert_int_equal(kt_st_count(f), N_SET);
    for (size_t i = 0; i < N_SET; i++) {
        const char *name;
        kt_tensor view, found;
        const kt_tensor *want = &ts->items[i].tensor;
        assert_int_equal(kt_st_entry(f, i, &name, &view), KT_OK);
        assert_string_equal(name, ts->items[i].name);
        assert_true(tu_bitwise_equal(&view, want));
        assert_int_equal(kt_st_find(f, name, &found), KT_OK);
        assert_ptr_equal(found.data, view.data);
        kt_tensor copy = tu_alloc(want->dtype, want->ndim, want->shape);
        assert_int_equal(kt_st_read(f, name, &copy), KT_OK);
        assert_true(tu_bitwise_equal(&copy, want));
        tu_free(&copy);
    }
    for (size_t i = 0; set_metadata[i] != NULL; i += 2)
        assert_string_equal(kt_st_metadata(f, set_metadata[i]), set_metadata[i + 1]);
    assert_null(kt_st_metadata(f, "absent"));
}

/* ---- round trips ----------------------------------------------------------------------------- */

static void test_roundtrip_memory(void **state)
{
    (void)state;
    tensor_set ts;
    make_set(&ts, 1);
    size_t size;
    assert_int_equal(kt_st_serialized_size(ts.items, N_SET, set_metadata, &size), KT_OK);
    unsigned char *buf = malloc(size);
    assert_non_null(buf);
    assert_int_equal(kt_st_serialize(ts.items, N_SET, set_metadata, buf, size), KT_OK);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--)
        header_len = header_len << 8 | buf[i];
    assert_int_equal(header_len % 8, 0); /* data 8-byte aligned */
    kt_st_file *f = NULL;
    assert_int_equal(kt_st_open_memory(buf, size, "mem", &f), KT_OK);
    check_set(f, &ts);
    kt_st_close(f);

    /* no tensors and no metadata is a valid (if dull) file */
    assert_int_equal(kt_st_serialized_size(NULL, 0, NULL, &size), KT_OK);
    assert_int_equal(size, 16);
    assert_int_equal(kt_st_serialize(NULL, 0, NULL, buf, size), KT_OK);
    assert_memory_equal(buf, "\x08\0\0\0\0\0\0\0{}      ", 16);
    assert_int_equal(kt_st_open_memory(buf, size, NULL, &f), KT_OK);
    assert_int_equal(kt_st_count(f), 0);
    assert_null(kt_st_metadata(f, "format"));
    kt_st_close(f);
    free(buf);
    free_set(&ts);
}

static void test_roundtrip_file(void **state)
{
    (void)state;
    tensor_set ts;
    make_set(&ts, 2);
    char *dir = tu_temp_dir("kt_st_test");
    char *path = join(dir, "model.safetensors");
    assert_int_equal(kt_st_save(path, ts.items, 3, NULL), KT_OK);
    /* saving again replaces the file atomically and leaves no temporary behind */
    assert_int_equal(kt_st_save(path, ts.items, N_SET, set_metadata), KT_OK);
    assert_int_equal(count_dir_entries(dir), 1);
    kt_st_file *f = NULL;
    assert_int_equal(kt_st_open(path, &f), KT_OK);
    check_set(f, &ts);
    kt_st_close(f);

    /* the file's bytes are exactly what kt_st_serialize produces */
    size_t size;
    assert_int_equal(kt_st_serialized_size(ts.items, N_SET, set_metadata, &size), KT_OK);
    unsigned char *want = malloc(size), *got = malloc(size + 1);
    assert_non_null(want);
    assert_non_null(got);
    assert_int_equal(kt_st_serialize(ts.items, N_SET, set_metadata, want, size), KT_OK);
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    assert_int_equal(fread(got, 1, size + 1, fp), size);
    fclose(fp);
    assert_memory_equal(got, want, size);
    free(want);
    free(got);
    free(path);
    remove_dir(dir);
    free_set(&ts);
}

/* The writer's format checked byte for byte against a file written out by hand: metadata
 * first, entries in the given order, escaped names, contiguous offsets, space padding. */
static void test_exact_bytes(void **state)
{
    (void)state;
    float a[2] = {1.0f, -2.0f};
    uint16_t b = 0x3f80; /* bf16 1.0 */
    kt_st_item items[3];
    assert_int_equal(kt_tensor_init(&items[0].tensor, a, KT_F32, 1, TU_SHAPE(2)), KT_OK);
    assert_int_equal(kt_tensor_init(&items[1].tensor, &b, KT_BF16, 0, NULL), KT_OK);
    assert_int_equal(kt_tensor_init(&items[2].tensor, NULL, KT_I32, 1, TU_SHAPE(0)), KT_OK);
    items[0].name = "a";
    items[1].name = "x\"y\\z\n\x01";
    items[2].name = "e";
    const char *const meta[] = {"format", "torch", NULL};
    static const char header[] =
        "{\"__metadata__\":{\"format\":\"torch\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"x\\\"y\\\\z\\n\\u0001\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[8,10]},"
        "\"e\":{\"dtype\":\"I32\",\"shape\":[0],\"data_offsets\":[10,10]}}"
        "     ";
    assert_int_equal(sizeof header - 1, 216);
    unsigned char want[8 + 216 + 10] = {0xd8, 0, 0, 0, 0, 0, 0, 0};
    memcpy(want + 8, header, 216);
    memcpy(want + 224, "\x00\x00\x80\x3f\x00\x00\x00\xc0\x80\x3f", 10);

    size_t size;
    assert_int_equal(kt_st_serialized_size(items, 3, meta, &size), KT_OK);
    assert_int_equal(size, sizeof want);
    unsigned char got[sizeof want + 4];
    memset(got, 0xee, sizeof got);
    assert_int_equal(kt_st_serialize(items, 3, meta, got, sizeof got), KT_OK);
    assert_memory_equal(got, want, sizeof want);
    assert_int_equal(got[sizeof want], 0xee); /* nothing written past the image */

    /* and the hand-written file reads back */
    kt_st_file *f = NULL;
    assert_int_equal(kt_st_open_memory(want, sizeof want, "exact", &f), KT_OK);
    kt_tensor t;
    assert_int_equal(kt_st_find(f, "x\"y\\z\n\x01", &t), KT_OK);
    assert_int_equal(t.dtype, KT_BF16);
    assert_int_equal(t.ndim, 0);
    assert_string_equal(kt_st_metadata(f, "format"), "torch");
    kt_st_close(f);
}

/* ---- the JSON parser ------------------------------------------------------------------------- */

static const kt__json_value *parse_ok(const char *text, kt__json_doc **doc)
{
    kt_status s = kt__json_parse(text, strlen(text), doc);
    if (s != KT_OK)
        fail_msg("'%s' did not parse: %s", text, kt_last_error());
    return kt__json_root(*doc);
}

static void expect_json_error(const char *text, const char *fragment)
{
    kt__json_doc *doc = NULL;
    TU_EXPECT_ERROR(kt__json_parse(text, strlen(text), &doc), KT_EFORMAT, "JSON at byte", fragment);
    assert_null(doc);
}

static void test_json(void **state)
{
    (void)state;
    kt__json_doc *doc = NULL;
    const kt__json_value *v =
        parse_ok(" {\"a\\u00e9\\ud83d\\ude00\\\"\\\\\\/\\b\\f\\n\\r\\t\": [true, false, null, "
                 "-0, 18446744073709551615, -9223372036854775808, {}, []]} ",
                 &doc);
    assert_int_equal(v->type, KT__JSON_OBJECT);
    assert_int_equal(v->u.list.count, 1);
    const kt__json_value *m = &v->u.list.items[0];
    assert_string_equal(m->key, "a\xc3\xa9\xf0\x9f\x98\x80\"\\/\b\f\n\r\t");
    assert_int_equal(m->type, KT__JSON_ARRAY);
    assert_int_equal(m->u.list.count, 8);
    const kt__json_value *it = m->u.list.items;
    assert_int_equal(it[0].u.boolean, 1);
    assert_int_equal(it[1].type, KT__JSON_BOOL);
    assert_int_equal(it[2].type, KT__JSON_NULL);
    assert_int_equal(it[3].u.integer.negative, 0);
    assert_true(it[4].u.integer.magnitude == UINT64_MAX);
    assert_true(it[5].u.integer.negative && it[5].u.integer.magnitude == (uint64_t)1 << 63);
    assert_int_equal(it[6].u.list.count, 0);
    assert_int_equal(it[7].type, KT__JSON_ARRAY);
    kt__json_free(doc);

    /* \u0000 decodes to a NUL the length still counts */
    v = parse_ok("\"a\\u0000b\"", &doc);
    assert_int_equal(v->u.string.len, 3);
    kt__json_free(doc);

    /* nesting: the bound itself is fine, one more is not */
    char deep[2 * KT__JSON_MAX_DEPTH + 3];
    memset(deep, '[', KT__JSON_MAX_DEPTH);
    memset(deep + KT__JSON_MAX_DEPTH, ']', KT__JSON_MAX_DEPTH);
    deep[2 * KT__JSON_MAX_DEPTH] = '\0';
    kt__json_free((parse_ok(deep, &doc), doc));
    memset(deep, '[', KT__JSON_MAX_DEPTH + 1);
    memset(deep + KT__JSON_MAX_DEPTH + 1, ']', KT__JSON_MAX_DEPTH + 1);
    deep[2 * KT__JSON_MAX_DEPTH + 2] = '\0';
    expect_json_error(deep, "nesting deeper than 16");

    expect_json_error("", "expected a value, found end of input");
    expect_json_error("   ", "byte 3");
    expect_json_error("{\"a\":1} x", "expected end of input");
    expect_json_error("\"abc", "expected '\"' to end the string");
    expect_json_error("\"a\\", "to end the string");
    expect_json_error("\"\\x\"", "after '\\'");
    expect_json_error("\"\\u12\"", "hex digit");
    expect_json_error("\"\\u12g4\"", "hex digit");
    expect_json_error("\"\\ud800\"", "low surrogate");
    expect_json_error("\"\\ud800\\u0041\"", "low surrogate");
    expect_json_error("\"\\udc00\"", "high surrogate");
    expect_json_error("\"a\tb\"", "control character");
    expect_json_error("\"\xff\"", "UTF-8");
    expect_json_error("\"\xc0\xaf\"", "UTF-8");         /* overlong '/' */
    expect_json_error("\"\xed\xa0\x80\"", "UTF-8");     /* encoded surrogate */
    expect_json_error("\"\xf4\x90\x80\x80\"", "UTF-8"); /* above U+10FFFF */
    expect_json_error("\"\xe2\x82\"", "UTF-8");         /* cut short */
    expect_json_error("01", "leading zeros");
    expect_json_error("-", "expected a digit");
    expect_json_error("1.5", "fractions");
    expect_json_error("1e3", "exponents");
    expect_json_error("18446744073709551616", "out of range");
    expect_json_error("-9223372036854775809", "out of range");
    expect_json_error("[1,]", "expected a value, found ']'");
    expect_json_error("[1 2]", "expected ',' or ']'");
    expect_json_error("{\"a\" 1}", "expected ':'");
    expect_json_error("{\"a\":1,}", "start an object key");
    expect_json_error("{1:2}", "start an object key");
    expect_json_error("tru", "expected a value");
    expect_json_error("nul", "expected a value");
    expect_json_error("[", "byte 1");
    expect_json_error("\x01", "byte 0x01");

    /* no NUL terminator is needed: the parser stops at len */
    const char unterminated[4] = {'[', '7', ']', 'x'};
    assert_int_equal(kt__json_parse(unterminated, 3, &doc), KT_OK);
    kt__json_free(doc);

    assert_true(kt__json_utf8_valid("caf\xc3\xa9", 5));
    assert_false(kt__json_utf8_valid("\xc3", 1));
}

/* ---- malformed files ------------------------------------------------------------------------- */

#define EXPECT_BAD(header, data_len, status, ...)                                                  \
    TU_EXPECT_ERROR(open_header((header), (data_len)), (status), "bad.st", __VA_ARGS__)

#define ENTRY(dtype, shape, offsets)                                                               \
    "{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":" offsets "}"

static void test_malformed_framing(void **state)
{
    (void)state;
    kt_st_file *f = NULL;
    unsigned char img[16] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
    for (size_t n = 0; n < 8; n++)
        TU_EXPECT_ERROR(kt_st_open_memory(img, n, "bad.st", &f), KT_EFORMAT, "bad.st",
                        "shorter than the 8-byte header length");
    TU_EXPECT_ERROR(kt_st_open_memory(NULL, 0, "bad.st", &f), KT_EFORMAT, "shorter");
    assert_null(f);

    unsigned char big[16] = {0};
    uint64_t len = (uint64_t)KT_ST_MAX_HEADER + 1;
    for (int i = 0; i < 8; i++)
        big[i] = (unsigned char)(len >> (8 * i));
    TU_EXPECT_ERROR(kt_st_open_memory(big, sizeof big, "bad.st", &f), KT_EFORMAT, "bad.st",
                    "header length 100000001 exceeds");
    memset(big, 0xff, 8); /* 2^64 - 1: must not wrap around */
    TU_EXPECT_ERROR(kt_st_open_memory(big, sizeof big, "bad.st", &f), KT_EFORMAT, "exceeds");
    big[0] = 9, memset(big + 1, 0, 7);
    TU_EXPECT_ERROR(kt_st_open_memory(big, sizeof big, "bad.st", &f), KT_EFORMAT, "bad.st",
                    "header length 9 extends past the end of the 16-byte file");
    assert_null(f);

    EXPECT_BAD("", 0, KT_EFORMAT, "header: JSON at byte 0");
    EXPECT_BAD("{\"a\":", 0, KT_EFORMAT, "header: JSON at byte 5", "expected a value");
    EXPECT_BAD("[]", 0, KT_EFORMAT, "header is a JSON array, not an object");
    EXPECT_BAD("\"x\"", 0, KT_EFORMAT, "header is a JSON string");
    EXPECT_BAD("{}", 4, KT_EFORMAT, "4 trailing bytes");
    assert_int_equal(open_header("{} \n\t", 0), KT_OK); /* whitespace padding is fine */
}

static void test_malformed_entries(void **state)
{
    (void)state;
    EXPECT_BAD("{\"w\":[1]}", 0, KT_EFORMAT, "tensor 'w'", "entry is a JSON array, not an object");
    EXPECT_BAD("{\"w\":{\"shape\":[],\"data_offsets\":[0,4]}}", 4, KT_EFORMAT, "tensor 'w'",
               "missing \"dtype\"");
    EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, KT_EFORMAT, "tensor 'w'",
               "missing \"shape\"");
    EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[]}}", 4, KT_EFORMAT, "tensor 'w'",
               "missing \"data_offsets\"");
    EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4],\"x\":1}}", 4,
               KT_EFORMAT, "tensor 'w'", "unknown key \"x\"");
    EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}",
               4, KT_EFORMAT, "tensor 'w'", "\"dtype\" appears twice");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[0,4]") ",\"w\":" ENTRY("F32", "[]", "[4,8]") "}", 8,
               KT_EFORMAT, "tensor 'w' appears twice");

    /* mistyped fields */
    EXPECT_BAD("{\"w\":{\"dtype\":32,\"shape\":[],\"data_offsets\":[0,4]}}", 4, KT_EFORMAT,
               "tensor 'w'", "\"dtype\" is a JSON integer, not a string");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "4", "[0,4]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "\"shape\" is a JSON integer, not an array");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[\"1\"]", "[0,4]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "shape[0] is a JSON string, not an integer");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[1.0]", "[0,4]") "}", 4, KT_EFORMAT, "fractions");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "{}") "}", 4, KT_EFORMAT, "tensor 'w'",
               "\"data_offsets\" is not a [begin, end] array");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[0,4,8]") "}", 4, KT_EFORMAT, "[begin, end]");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[null,4]") "}", 4, KT_EFORMAT,
               "data_offsets[0] is a JSON null, not an integer");

    /* dtypes libkt has no tensor for: the file opens (sizes checked by the element's bits),
     * the tensor has no view */
    static const struct {
        const char *dtype;
        int bytes;
    } foreign[] = {{"F64", 8}, {"I8", 1}, {"U8", 1}, {"BOOL", 1}, {"U64", 8}, {"F8_E4M3", 1},
                   {"C64", 8}, {"I16", 2}};
    for (size_t i = 0; i < sizeof foreign / sizeof foreign[0]; i++) {
        char h[160];
        snprintf(h, sizeof h, "{\"w\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%d]}}",
                 foreign[i].dtype, 3 * foreign[i].bytes);
        size_t size;
        unsigned char *img = make_image(h, 3 * (size_t)foreign[i].bytes, &size);
        kt_st_file *f = NULL;
        OK(kt_st_open_memory(img, size, "odd.st", &f));
        kt_tensor view;
        kt_st_info info;
        const char *name = NULL;
        TU_EXPECT_ERROR(kt_st_find(f, "w", &view), KT_EUNSUPPORTED, "odd.st", "tensor 'w'",
                        foreign[i].dtype, "no such dtype");
        TU_EXPECT_ERROR(kt_st_entry(f, 0, &name, &view), KT_EUNSUPPORTED, foreign[i].dtype);
        OK(kt_st_entry(f, 0, &name, NULL));
        assert_string_equal(name, "w");
        OK(kt_st_entry_info(f, 0, &info));
        assert_string_equal(info.file_dtype, foreign[i].dtype);
        assert_int_equal(info.dtype, KT_DTYPE_COUNT);
        assert_int_equal(info.nbytes, 3 * foreign[i].bytes);
        assert_int_equal(info.file_offset, 8 + strlen(h)); /* the first of the data section */
        kt_st_close(f);
        free(img);
        snprintf(h, sizeof h, "{\"w\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,3]}}",
                 foreign[i].dtype);
        if (foreign[i].bytes > 1)
            EXPECT_BAD(h, 3, KT_EFORMAT, "tensor 'w'", foreign[i].dtype, "needs");
    }
    /* packed dtypes: a whole number of bytes */
    assert_int_equal(open_header("{\"w\":" ENTRY("F4", "[4]", "[0,2]") "}", 2), KT_OK);
    EXPECT_BAD("{\"w\":" ENTRY("F4", "[3]", "[0,2]") "}", 2, KT_EFORMAT, "tensor 'w'",
               "F4[3] is not a whole number of bytes");
    assert_int_equal(open_header("{\"w\":" ENTRY("F6_E2M3", "[4]", "[0,3]") "}", 3), KT_OK);
    EXPECT_BAD("{\"w\":" ENTRY("F33", "[]", "[0,4]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "\"F33\" is not a safetensors dtype");
    EXPECT_BAD("{\"w\":" ENTRY("f32", "[]", "[0,4]") "}", 4, KT_EFORMAT, "not a safetensors");

    /* shapes */
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[1,1,1,1,1]", "[0,4]") "}", 4, KT_EUNSUPPORTED, "tensor 'w'",
               "5 dimensions, more than the 4");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[2,-1]", "[0,4]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "shape[1] is negative");
    /* empty, but its other dimensions beyond what a kt_tensor can describe */
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[2305843009213693952,0]", "[0,0]") "}", 0, KT_EFORMAT,
               "tensor 'w'", "too large");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[9223372036854775808]", "[0,4]") "}", 4, KT_EFORMAT,
               "tensor 'w'", "shape[0] (9223372036854775808) is out of range");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[4294967296,4294967296]", "[0,4]") "}", 4, KT_EFORMAT,
               "tensor 'w'", "too large");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[4611686018427387904]", "[0,4]") "}", 4, KT_EFORMAT,
               "tensor 'w'", "too large"); /* numel fits, bytes do not */
    /* a zero dimension makes the tensor empty, but the other dimensions must still have a
     * product a kt_tensor can describe (strides are computed from it: at most INT64_MAX / 16) */
    assert_int_equal(
        open_header("{\"w\":" ENTRY("F32", "[0,536870912,536870912]", "[0,0]") "}", 0), KT_OK);
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[0,2147483648,2147483648]", "[0,0]") "}", 0, KT_EFORMAT,
               "tensor 'w'", "too large");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[9223372036854775807,9223372036854775807,0]", "[0,0]") "}",
               0, KT_EFORMAT, "tensor 'w'", "too large");

    /* offsets */
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[4,0]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "data_offsets [4, 0] end before they begin");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[0,4]") "}", 3, KT_EFORMAT, "tensor 'w'",
               "extend past the 3-byte data section");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[-1,4]") "}", 4, KT_EFORMAT, "tensor 'w'",
               "data_offsets[0] is negative");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[]", "[18446744073709551615,18446744073709551615]") "}", 4,
               KT_EFORMAT, "tensor 'w'", "extend past");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[3]", "[0,8]") "}", 8, KT_EFORMAT, "tensor 'w'",
               "hold 8 bytes but f32[3] needs 12");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[2]", "[0,8]") ",\"v\":" ENTRY("I32", "[1]", "[4,8]") "}", 8,
               KT_EFORMAT, "tensor 'v'", "overlap tensor 'w'");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[1]", "[4,8]") "}", 8, KT_EFORMAT, "tensor 'w'",
               "bytes [0, 4) before it belong to no tensor");
    EXPECT_BAD("{\"w\":" ENTRY("F32", "[1]", "[0,4]") "}", 8, KT_EFORMAT,
               "4 trailing bytes after the last tensor");
    /* order in the header need not follow the data, and zero-size tensors fit anywhere */
    assert_int_equal(
        open_header("{\"w\":" ENTRY("F32", "[1]", "[4,8]") ",\"v\":" ENTRY(
                        "I32", "[1]", "[0,4]") ",\"z\":" ENTRY("I64", "[0]", "[4,4]") "}",
                    8),
        KT_OK);

    /* names */
    EXPECT_BAD("{\"w\\u0000x\":" ENTRY("F32", "[]", "[0,4]") "}", 4, KT_EFORMAT,
               "the name contains a NUL");
}

static void test_malformed_metadata(void **state)
{
    (void)state;
    EXPECT_BAD("{\"__metadata__\":[]}", 0, KT_EFORMAT,
               "\"__metadata__\" is a JSON array, not an object");
    EXPECT_BAD("{\"__metadata__\":{\"a\":\"b\",\"n\":1}}", 0, KT_EFORMAT,
               "\"__metadata__\" value of 'n' is a JSON integer, not a string");
    EXPECT_BAD("{\"__metadata__\":{\"a\":{}}}", 0, KT_EFORMAT, "value of 'a' is a JSON object");
    EXPECT_BAD("{\"__metadata__\":{\"a\":\"b\",\"a\":\"c\"}}", 0, KT_EFORMAT,
               "key 'a' appears twice");
    EXPECT_BAD("{\"__metadata__\":{},\"__metadata__\":{}}", 0, KT_EFORMAT,
               "\"__metadata__\" appears twice");
    EXPECT_BAD("{\"__metadata__\":{\"a\":\"x\\u0000\"}}", 0, KT_EFORMAT, "NUL character");
    EXPECT_BAD("{\"__metadata__\":{\"a\\u0000\":\"x\"}}", 0, KT_EFORMAT, "NUL character");
}

/* ---- truncation and corruption --------------------------------------------------------------- */

static unsigned char *small_file(size_t *size_out)
{
    float a[6] = {1, 2, 3, 4, 5, 6};
    int64_t b[2] = {-1, 1};
    uint16_t c[3] = {1, 2, 3};
    kt_st_item items[4] = {{"alpha", {0}}, {"beta", {0}}, {"gamma", {0}}, {"empty", {0}}};
    assert_int_equal(kt_tensor_init(&items[0].tensor, a, KT_F32, 2, TU_SHAPE(2, 3)), KT_OK);
    assert_int_equal(kt_tensor_init(&items[1].tensor, b, KT_I64, 1, TU_SHAPE(2)), KT_OK);
    assert_int_equal(kt_tensor_init(&items[2].tensor, c, KT_BF16, 1, TU_SHAPE(3)), KT_OK);
    assert_int_equal(kt_tensor_init(&items[3].tensor, NULL, KT_F16, 2, TU_SHAPE(0, 2)), KT_OK);
    const char *const meta[] = {"k", "v", NULL};
    size_t size;
    assert_int_equal(kt_st_serialized_size(items, 4, meta, &size), KT_OK);
    unsigned char *buf = malloc(size);
    assert_non_null(buf);
    assert_int_equal(kt_st_serialize(items, 4, meta, buf, size), KT_OK);
    *size_out = size;
    return buf;
}

/* Every truncation loses tensor bytes, header bytes or the length itself: with no trailing
 * bytes allowed, none of them is a valid file. */
static void test_truncation(void **state)
{
    (void)state;
    size_t size;
    unsigned char *full = small_file(&size);
    for (size_t len = 0; len < size; len++) {
        unsigned char *cut = malloc(len ? len : 1);
        assert_non_null(cut);
        memcpy(cut, full, len);
        kt_st_file *f = NULL;
        kt_status s = kt_st_open_memory(cut, len, "cut.st", &f);
        if (s != KT_EFORMAT)
            fail_msg("truncated to %zu of %zu bytes: status %d (%s)", len, size, s,
                     kt_last_error());
        assert_null(f);
        assert_non_null(strstr(kt_last_error(), "cut.st"));
        free(cut);
    }
    free(full);
}

/* A file that opened must describe itself consistently: every view lies inside the image
 * with numel * element size bytes, lookups agree, and reads succeed. */
static void check_consistent(const kt_st_file *f, const unsigned char *img, size_t size)
{
    size_t covered = 0;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name;
        kt_tensor v, w;
        assert_int_equal(kt_st_entry(f, i, &name, &v), KT_OK);
        size_t bytes = kt_tensor_nbytes(&v);
        const unsigned char *p = v.data;
        assert_true(p >= img + 8 && p <= img + size && bytes <= (size_t)(img + size - p));
        covered += bytes;
        assert_int_equal(kt_st_find(f, name, &w), KT_OK);
        assert_ptr_equal(w.data, v.data);
        if (bytes <= 4096) {
            kt_tensor copy = tu_alloc(v.dtype, v.ndim, v.shape);
            assert_int_equal(kt_st_read(f, name, &copy), KT_OK);
            assert_memory_equal(copy.data, v.data, bytes);
            tu_free(&copy);
        }
    }
    assert_true(covered <= size);
}

static void test_corruption(void **state)
{
    (void)state;
    size_t size;
    unsigned char *orig = small_file(&size);
    unsigned char *img = malloc(size);
    assert_non_null(img);
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    int opened = 0, rejected = 0;
    for (int trial = 0; trial < 5000; trial++) {
        memcpy(img, orig, size);
        size_t at = (size_t)(tu_rng_next(&rng) % size);
        /* most trials hit the header, where the interesting failures are */
        if (trial % 4 != 0) {
            size_t header_end = 8 + (size_t)orig[0] + ((size_t)orig[1] << 8);
            at = (size_t)(tu_rng_next(&rng) % header_end);
        }
        img[at] = (unsigned char)(img[at] ^ (1 + tu_rng_next(&rng) % 255));
        kt_st_file *f = NULL;
        kt_status s = kt_st_open_memory(img, size, "corrupt.st", &f);
        if (s == KT_OK) {
            check_consistent(f, img, size);
            kt_st_close(f);
            opened++;
        } else {
            if (s != KT_EFORMAT && s != KT_EUNSUPPORTED)
                fail_msg("byte %zu corrupted: status %d (%s)", at, s, kt_last_error());
            assert_non_null(strstr(kt_last_error(), "corrupt.st"));
            assert_null(f);
            rejected++;
        }
    }
    /* both outcomes happen: data-byte corruption opens, header corruption mostly fails */
    assert_true(opened > 0);
    assert_true(rejected > 0);
    free(img);
    free(orig);
}

/* ---- bad calls ------------------------------------------------------------------------------- */

static void test_read_errors(void **state)
{
    (void)state;
    size_t size;
    unsigned char *img = small_file(&size);
    kt_st_file *f = NULL;
    assert_int_equal(kt_st_open_memory(img, size, "small.st", &f), KT_OK);
    kt_tensor dst = tu_new(KT_BF16, 2, 3);
    TU_EXPECT_ERROR(kt_st_read(f, "alpha", &dst), KT_EINVAL, "small.st", "tensor 'alpha'",
                    "f32[2,3]", "bf16[2,3]");
    tu_free(&dst);
    dst = tu_new(KT_F32, 3, 2);
    TU_EXPECT_ERROR(kt_st_read(f, "alpha", &dst), KT_EINVAL, "f32[2,3]", "f32[3,2]");
    kt_tensor tr;
    assert_int_equal(kt_tensor_transpose(&dst, 0, 1, &tr), KT_OK);
    TU_EXPECT_ERROR(kt_st_read(f, "alpha", &tr), KT_EINVAL, "contiguous");
    tu_free(&dst);
    dst = tu_new(KT_F32, 2, 3);
    assert_int_equal(kt_st_read(f, "alpha", &dst), KT_OK);
    assert_true(tu_get(&dst, 5) == 6.0);
    tu_free(&dst);

    kt_tensor view;
    TU_EXPECT_ERROR(kt_st_find(f, "missing", &view), KT_EINVAL, "small.st",
                    "no tensor named 'missing'");
    TU_EXPECT_ERROR(kt_st_read(f, "missing", &dst), KT_EINVAL, "no tensor named 'missing'");
    TU_EXPECT_ERROR(kt_st_entry(f, 4, NULL, &view), KT_EINVAL, "index 4 out of range");
    TU_EXPECT_ERROR(kt_st_entry(NULL, 0, NULL, &view), KT_EINVAL, "NULL");
    assert_int_equal(kt_st_count(NULL), 0);
    assert_null(kt_st_metadata(NULL, "k"));
    assert_string_equal(kt_st_metadata(f, "k"), "v");
    kt_st_close(f);
    kt_st_close(NULL);
    free(img);
}

static void test_write_errors(void **state)
{
    (void)state;
    kt_tensor t = tu_new(KT_F32, 2, 3);
    kt_st_item items[2] = {{"a", t}, {"b", t}};
    size_t size;
    char buf[512];

    items[1].name = NULL;
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL, "item 1 has no name");
    items[1].name = "a";
    TU_EXPECT_ERROR(kt_st_serialize(items, 2, NULL, buf, sizeof buf), KT_EINVAL,
                    "tensor name 'a' appears twice");
    items[1].name = "__metadata__";
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL, "reserved");
    items[1].name = "bad\xff";
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL, "UTF-8");
    items[1].name = "b";
    assert_int_equal(kt_tensor_transpose(&t, 0, 1, &items[1].tensor), KT_OK);
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL,
                    "tensor 'b' is not contiguous");
    items[1].tensor = t;
    items[1].tensor.device.type = KT_DEVICE_CUDA;
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL,
                    "tensor 'b' is not on the CPU");
    items[1].tensor = t;
    items[1].tensor.data = NULL;
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, NULL, &size), KT_EINVAL, "has no data");
    items[1].tensor = t;

    const char *const odd[] = {"k", NULL};
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, odd, &size), KT_EINVAL,
                    "metadata key 'k' has no value");
    const char *const dup[] = {"k", "1", "k", "2", NULL};
    TU_EXPECT_ERROR(kt_st_serialized_size(items, 2, dup, &size), KT_EINVAL,
                    "metadata key 'k' appears twice");
    TU_EXPECT_ERROR(kt_st_serialized_size(NULL, 1, NULL, &size), KT_EINVAL, "items is NULL");

    assert_int_equal(kt_st_serialized_size(items, 2, NULL, &size), KT_OK);
    memset(buf, 0x5a, sizeof buf);
    TU_EXPECT_ERROR(kt_st_serialize(items, 2, NULL, buf, size - 1), KT_EINVAL, "needed");
    assert_int_equal((unsigned char)buf[0], 0x5a); /* untouched on failure */

    /* a failed save names the path and leaves nothing behind */
    char *dir = tu_temp_dir("kt_st_test");
    char *missing = join(dir, "no/such/dir.st");
    TU_EXPECT_ERROR(kt_st_save(missing, items, 2, NULL), KT_EIO, missing,
                    "No such file or directory");
    char *sub = join(dir, "sub");
    assert_int_equal(mkdir(sub, 0700), 0);
    TU_EXPECT_ERROR(kt_st_save(sub, items, 2, NULL), KT_EINVAL, sub, "is a directory");
    assert_int_equal(count_dir_entries(dir), 1);
    TU_EXPECT_ERROR(kt_st_save(sub, items, 1, dup), KT_EINVAL, "kt_st_save");
    free(missing);
    free(sub);
    remove_dir(dir);
    tu_free(&t);
}

static void test_open_errors(void **state)
{
    (void)state;
    kt_st_file *f = NULL;
    TU_EXPECT_ERROR(kt_st_open("/nonexistent/x.safetensors", &f), KT_EIO,
                    "/nonexistent/x.safetensors", "No such file or directory");
    char *dir = tu_temp_dir("kt_st_test");
    /* a directory is a checkpoint directory (tests/test_io_sharded.c), here an empty one */
    TU_EXPECT_ERROR(kt_st_open(dir, &f), KT_EIO, dir, "model.safetensors.index.json",
                    "model.safetensors");
    char *empty = join(dir, "empty.st");
    FILE *fp = fopen(empty, "wb");
    assert_non_null(fp);
    fclose(fp);
    TU_EXPECT_ERROR(kt_st_open(empty, &f), KT_EFORMAT, empty, "shorter");
    /* a corrupt file on disk is reported under its path */
    fp = fopen(empty, "wb");
    assert_non_null(fp);
    fwrite("\x02\0\0\0\0\0\0\0[]", 1, 10, fp);
    fclose(fp);
    TU_EXPECT_ERROR(kt_st_open(empty, &f), KT_EFORMAT, empty, "not an object");
    assert_null(f);
    TU_EXPECT_ERROR(kt_st_open(NULL, &f), KT_EINVAL, "NULL");
    free(empty);
    remove_dir(dir);
}

/* Starts a child that writes img (then zeros until the reader goes, when endless) into a new
 * pipe; returns the read end. */
static int pipe_from_child(const unsigned char *img, size_t size, int endless, pid_t *child_out)
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    fflush(NULL);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        close(p[0]);
        static const unsigned char zeros[65536];
        int ok = write(p[1], img, size) == (ssize_t)size;
        while (ok && endless) /* until the reader closes its end */
            ok = write(p[1], zeros, sizeof zeros) == (ssize_t)sizeof zeros;
        _exit(ok || endless ? 0 : 1);
    }
    close(p[1]);
    *child_out = child;
    return p[0];
}

/* What cannot be mapped is read instead: an anonymous pipe (a shell's <(...)), fed by a child
 * process, with a file large enough that the read buffer has to grow. A named FIFO or a device
 * is refused at once: opening one could wait forever for a writer. */
static void test_open_unmappable(void **state)
{
    (void)state;
    kt_tensor big = tu_new(KT_F32, 50000);
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    tu_fill_uniform(&big, &rng, -1, 1);
    kt_st_item item = {"big", big};
    size_t size;
    assert_int_equal(kt_st_serialized_size(&item, 1, NULL, &size), KT_OK);
    unsigned char *img = malloc(size);
    assert_non_null(img);
    assert_int_equal(kt_st_serialize(&item, 1, NULL, img, size), KT_OK);
    pid_t child;
    int fd = pipe_from_child(img, size, 0, &child);
    char path[64];
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    kt_st_file *f = NULL;
    kt_status s = kt_st_open(path, &f);
    close(fd);
    int wstatus;
    assert_int_equal(waitpid(child, &wstatus, 0), child);
    assert_int_equal(s, KT_OK);
    assert_true(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
    kt_tensor view;
    assert_int_equal(kt_st_find(f, "big", &view), KT_OK);
    assert_true(tu_bitwise_equal(&view, &big));
    kt_st_close(f);

    /* a stream that never ends is read only as far as its header reaches (and a byte more,
     * which is reported as trailing data), not until memory runs out */
    f = NULL;
    fd = pipe_from_child(img, size, 1, &child);
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    s = kt_st_open(path, &f);
    close(fd);
    kill(child, SIGKILL);
    assert_int_equal(waitpid(child, &wstatus, 0), child);
    TU_EXPECT_ERROR(s, KT_EFORMAT, path, "1 trailing bytes");
    assert_null(f);

    char *dir = tu_temp_dir("kt_st_test");
    char *fifo = join(dir, "pipe.st");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    TU_EXPECT_ERROR(kt_st_open(fifo, &f), KT_EINVAL, fifo, "FIFO");
    TU_EXPECT_ERROR(kt_st_open("/dev/zero", &f), KT_EINVAL, "/dev/zero", "character device");
    assert_null(f);
    free(fifo);
    remove_dir(dir);
    free(img);
    tu_free(&big);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_memory),   cmocka_unit_test(test_roundtrip_file),
        cmocka_unit_test(test_exact_bytes),        cmocka_unit_test(test_json),
        cmocka_unit_test(test_malformed_framing),  cmocka_unit_test(test_malformed_entries),
        cmocka_unit_test(test_malformed_metadata), cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_corruption),         cmocka_unit_test(test_read_errors),
        cmocka_unit_test(test_write_errors),       cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_open_unmappable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
