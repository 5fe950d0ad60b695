/* Programs: .ktp round trips, damaged files (truncated, flipped, and content corrupted under a
 * valid checksum), hand-edited ones whose data flow is wrong, program files that are pipes,
 * directories or too large, zero allocations while running, bad builds, and compile
 * options. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

/* The project root is not on the test targets' include path (only lib/ is), so the
 * library-internal header is named relative to this file. */
#include "graph/runtime/bytes.h"

#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif

/* ---- counting heap allocations (not under ASan, which owns malloc) ------------------------ */

#ifndef TEST_ASAN
static atomic_int alloc_counting;
static atomic_long alloc_count;

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t size);
extern void __libc_free(void *p);
extern void *__libc_memalign(size_t align, size_t size);
void *memalign(size_t align, size_t size);

static void counted(void)
{
    if (atomic_load_explicit(&alloc_counting, memory_order_relaxed))
        atomic_fetch_add(&alloc_count, 1);
}

void *malloc(size_t size)
{
    counted();
    return __libc_malloc(size);
}

void *calloc(size_t n, size_t size)
{
    counted();
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t size)
{
    counted();
    return __libc_realloc(p, size);
}

void free(void *p)
{
    if (p != NULL)
        counted();
    __libc_free(p);
}

void *memalign(size_t align, size_t size)
{
    counted();
    return __libc_memalign(align, size);
}

int posix_memalign(void **out, size_t align, size_t size)
{
    counted();
    if (align < sizeof(void *) || (align & (align - 1)) != 0)
        return EINVAL;
    void *p = __libc_memalign(align, size);
    if (p == NULL)
        return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t align, size_t size)
{
    counted();
    return __libc_memalign(align, size);
}
#endif

/* ---- models ------------------------------------------------------------------------------ */

enum { MN = 24, MD = 16, MH = 32, MC = 5 };

/* MLP: loss = CE(silu(x W1 + b1) W2, y) */
static kt_graph *build_mlp(void)
{
    kt_graph *g;
    kt_value x, y, w1, b1, w2, h, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(MN, MD), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(MN), &y));
    OK(kt_graph_param(g, "w1", KT_F32, 2, TU_SHAPE(MD, MH), kt_init_normal(0.3f), &w1));
    OK(kt_graph_param(g, "b1", KT_F32, 1, TU_SHAPE(MH), kt_init_normal(0.1f), &b1));
    OK(kt_graph_param(g, "w2", KT_F32, 2, TU_SHAPE(MH, MC), kt_init_normal(0.3f), &w2));
    h = tu_op2(g, "fc1", KT_OP_MATMUL, NULL, x, w1);
    h = tu_op2(g, "bias1", KT_OP_ADD, NULL, h, b1);
    h = tu_op1(g, "act", KT_OP_SILU, NULL, h);
    logits = tu_op2(g, "fc2", KT_OP_MATMUL, NULL, h, w2);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, NULL, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static kt_program *compile_mlp(void)
{
    kt_graph *g = build_mlp();
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* Inputs by index: floats uniform in [-1, 1), integers (targets) in [0, MC). Returns 0 when
 * an input cannot be reached (a damaged program may carry damaged names). */
static int fill_inputs(kt_session *s, const kt_program *p, uint64_t seed)
{
    tu_rng r;
    tu_rng_seed(&r, seed);
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *name;
        kt_tensor t;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, NULL) != KT_OK ||
            kt_session_tensor(s, KT_ROLE_INPUT, name, &t) != KT_OK)
            return 0;
        if (t.dtype == KT_I32 || t.dtype == KT_I64)
            tu_fill_uniform(&t, &r, 0, MC);
        else
            tu_fill_uniform(&t, &r, -1, 1);
    }
    return 1;
}

/* Everything a run produces: outputs, the loss, every gradient, and the parameters after one
 * SGD step, as copies (by name order of the program's tables). */
typedef struct run_result {
    float loss;
    int n;
    kt_tensor t[16];
    char name[16][32];
} run_result;

static void keep(run_result *r, const char *prefix, const char *name, const kt_tensor *t)
{
    assert_true(r->n < 16);
    r->t[r->n] = tu_clone(t);
    snprintf(r->name[r->n], sizeof r->name[r->n], "%s %s", prefix, name);
    r->n++;
}

static void keep_role(run_result *r, kt_session *s, const kt_program *p, kt_tensor_role role,
                      const char *prefix)
{
    for (int i = 0; i < kt_program_count(p, role); i++) {
        const char *name;
        kt_tensor t;
        OK(kt_program_tensor_info(p, role, i, &name, NULL));
        OK(kt_session_tensor(s, role, name, &t));
        keep(r, prefix, name, &t);
    }
}

static void run_mlp(const kt_program *p, kt_threadpool *pool, run_result *r)
{
    memset(r, 0, sizeof *r);
    kt_session_options so = {.pool = pool, .seed = 7,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s;
    OK(kt_session_create(p, &so, &s));
    assert_true(fill_inputs(s, p, 3));
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    r->loss = kt_session_loss(s);
    keep_role(r, s, p, KT_ROLE_OUTPUT, "output");
    keep_role(r, s, p, KT_ROLE_GRAD, "gradient");
    OK(kt_session_step(s));
    keep_role(r, s, p, KT_ROLE_PARAM, "stepped parameter");
    kt_session_destroy(s);
}

static void expect_same_results(const run_result *a, const run_result *b)
{
    assert_true(isfinite(a->loss) && a->loss > 0);
    assert_memory_equal(&a->loss, &b->loss, sizeof a->loss);
    assert_int_equal(a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        assert_string_equal(a->name[i], b->name[i]);
        if (!tu_bitwise_equal(&a->t[i], &b->t[i]))
            fail_msg("%s differs after the round trip", a->name[i]);
    }
}

static void free_results(run_result *r)
{
    for (int i = 0; i < r->n; i++)
        tu_free(&r->t[i]);
}

static unsigned char *serialize(const kt_program *p, size_t *n)
{
    OK(kt_program_serialized_size(p, n));
    unsigned char *buf = malloc(*n);
    assert_non_null(buf);
    OK(kt_program_serialize(p, buf, *n));
    return buf;
}

static char *describe(const kt_program *p)
{
    size_t n = kt_program_describe(p, NULL, 0);
    char *text = malloc(n + 1);
    assert_non_null(text);
    assert_int_equal(kt_program_describe(p, text, n + 1), n);
    assert_int_equal(strlen(text), n);
    return text;
}

/* ---- round trip ---------------------------------------------------------------------------- */

static void test_round_trip(void **state)
{
    (void)state;
    kt_threadpool *pool;
    OK(kt_threadpool_create(2, &pool));
    kt_program *p = compile_mlp();
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    assert_true(n > 28);
    assert_memory_equal(bytes, "KTPROGRM", 8);
    /* a buffer one byte short is refused */
    TU_EXPECT_ERROR(kt_program_serialize(p, bytes, n - 1), KT_EINVAL, "needed");

    char path[] = "/tmp/kt_test_program_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    OK(kt_program_save(p, path));
    /* the file holds exactly the serialised bytes */
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char *file = malloc(n + 1);
    assert_non_null(file);
    assert_int_equal(fread(file, 1, n + 1, f), n);
    fclose(f);
    assert_memory_equal(file, bytes, n);
    free(file);

    kt_program *from_file, *from_memory;
    OK(kt_program_load(path, &from_file));
    unlink(path);
    OK(kt_program_load_memory(bytes, n, &from_memory));
    kt_program *gone = from_memory; /* a failed load leaves NULL, never a stale handle */
    TU_EXPECT_ERROR(kt_program_load(path, &gone), KT_EIO, path);
    assert_null(gone);

    /* the same listing, the same bytes again */
    char *d0 = describe(p), *d1 = describe(from_file), *d2 = describe(from_memory);
    assert_string_equal(d0, d1);
    assert_string_equal(d0, d2);
    assert_non_null(strstr(d0, "fc1"));
    size_t n1, n2;
    unsigned char *again = serialize(from_file, &n1), *again2 = serialize(from_memory, &n2);
    assert_int_equal(n1, n);
    assert_int_equal(n2, n);
    assert_memory_equal(again, bytes, n);
    assert_memory_equal(again2, bytes, n);

    kt_program_stats s0, s1;
    kt_program_get_stats(p, &s0);
    kt_program_get_stats(from_file, &s1);
    assert_int_equal(s0.n_forward_steps, s1.n_forward_steps);
    assert_int_equal(s0.n_backward_steps, s1.n_backward_steps);
    assert_int_equal(s0.n_buffers, s1.n_buffers);
    assert_int_equal(s0.arena_bytes, s1.arena_bytes);
    assert_int_equal(s0.lower_bound_bytes, s1.lower_bound_bytes);
    assert_true(s0.forward_flops == s1.forward_flops && s0.forward_flops > 0);
    assert_true(s0.backward_flops == s1.backward_flops && s0.backward_flops > 0);

    /* a fresh session over each program computes the same bits */
    run_result r0, r1, r2;
    run_mlp(p, pool, &r0);
    run_mlp(from_file, pool, &r1);
    run_mlp(from_memory, pool, &r2);
    assert_int_equal(r0.n, 1 + 3 + 3); /* logits, 3 gradients, 3 stepped parameters */
    expect_same_results(&r0, &r1);
    expect_same_results(&r0, &r2);

    free_results(&r0);
    free_results(&r1);
    free_results(&r2);
    free(d0);
    free(d1);
    free(d2);
    free(again);
    free(again2);
    free(bytes);
    kt_program_destroy(p);
    kt_program_destroy(from_file);
    kt_program_destroy(from_memory);
    kt_threadpool_destroy(pool);
}

/* ---- the .ktp layout (program_io.c), for patching fields in place ------------------------- */

enum {
    H_VERSION = 8, H_FLAGS = 12, H_BODY = 16, /* header: 24 bytes */
    C_N_BUFS = 24, C_N_STEPS = 28, C_N_FORWARD = 32, C_N_ENTRIES = 36, C_LOSS = 48,
    C_REGION = 52, C_LOWER = 76, C_STRLEN = 84, C_END = 92,
    /* a buffer record */
    B_DTYPE = 0, B_NDIM = 4, B_SHAPE = 8, B_REGION = 40, B_OFFSET = 44, B_BYTES = 52,
    B_FIRST = 60, B_LAST = 64, B_STORAGE = 68, B_SIZE = 72,
    /* a step record: kind, op name length, op name, then (from the end of the name) */
    S_KIND = 0, S_OPLEN = 4, S_OPNAME = 8,
    S_ATTRS = 0, S_N_IN = 272, S_N_OUT = 276, S_IN = 280, S_OUT = 312, S_GOUT = 320,
    S_GIN = 328, S_SCRATCH = 360, S_NAME = 364, S_FLAGS = 368, S_FLOPS = 372, S_TAIL = 380,
    /* an entry record */
    E_NAME = 0, E_BUF = 4, E_GRAD = 8, E_INIT = 12, E_A = 16, E_B = 20, E_SHARD = 24, E_SIZE = 28,
    MAX_STEPS = 64
};

typedef struct layout {
    int32_t n_bufs, n_steps, n_entries[3];
    size_t step[MAX_STEPS];  /* where each step record starts */
    size_t fields[MAX_STEPS]; /* where its fields after the op name start */
    size_t entries[3];
    size_t names;
    uint64_t names_len;
} layout;

static uint32_t rd_u32(const unsigned char *b, size_t at)
{
    return (uint32_t)b[at] | (uint32_t)b[at + 1] << 8 | (uint32_t)b[at + 2] << 16 |
           (uint32_t)b[at + 3] << 24;
}

static int32_t rd_i32(const unsigned char *b, size_t at) { return (int32_t)rd_u32(b, at); }

static uint64_t rd_u64(const unsigned char *b, size_t at)
{
    return (uint64_t)rd_u32(b, at) | (uint64_t)rd_u32(b, at + 4) << 32;
}

static void wr_u32(unsigned char *b, size_t at, uint32_t v)
{
    for (int k = 0; k < 4; k++)
        b[at + (size_t)k] = (unsigned char)(v >> (8 * k));
}

static void wr_i32(unsigned char *b, size_t at, int32_t v) { wr_u32(b, at, (uint32_t)v); }

static void wr_u64(unsigned char *b, size_t at, uint64_t v)
{
    wr_u32(b, at, (uint32_t)v);
    wr_u32(b, at + 4, (uint32_t)(v >> 32));
}

static void fix_crc(unsigned char *b, size_t n) { wr_u32(b, n - 4, kt__crc32(b, n - 4)); }

/* Finds the records from the counts and the op name lengths (it reads nothing else). */
static layout find_layout(const unsigned char *b, size_t n)
{
    layout L;
    memset(&L, 0, sizeof L);
    L.n_bufs = rd_i32(b, C_N_BUFS);
    L.n_steps = rd_i32(b, C_N_STEPS);
    assert_true(L.n_bufs > 0 && L.n_steps > 0 && L.n_steps <= MAX_STEPS);
    size_t at = C_END + (size_t)L.n_bufs * B_SIZE;
    for (int32_t i = 0; i < L.n_steps; i++) {
        L.step[i] = at;
        L.fields[i] = at + S_OPNAME + rd_u32(b, at + S_OPLEN);
        at = L.fields[i] + S_TAIL;
    }
    for (int r = 0; r < 3; r++) {
        L.n_entries[r] = rd_i32(b, C_N_ENTRIES + 4 * (size_t)r);
        L.entries[r] = at;
        at += (size_t)L.n_entries[r] * E_SIZE;
    }
    L.names = at;
    L.names_len = rd_u64(b, C_STRLEN);
    /* the layout accounts for every byte: body, then the CRC */
    assert_int_equal(L.names + L.names_len + 4, n);
    assert_int_equal(24 + rd_u64(b, H_BODY) + 4, n);
    return L;
}

static size_t buf_at(const layout *L, int32_t i, size_t field)
{
    assert_true(i >= 0 && i < L->n_bufs);
    return C_END + (size_t)i * B_SIZE + field;
}

static size_t step_at(const layout *L, int32_t i, size_t field) { return L->fields[i] + field; }

static size_t entry_at(const layout *L, int role, int32_t i, size_t field)
{
    return L->entries[role] + (size_t)i * E_SIZE + field;
}

static unsigned char *copy_of(const unsigned char *b, size_t n)
{
    unsigned char *c = malloc(n ? n : 1);
    assert_non_null(c);
    memcpy(c, b, n);
    return c;
}

/* Loads a patched copy (CRC fixed) and expects KT_EFORMAT with the given fragments. */
#define EXPECT_REJECTED(bytes, n, ...)                                                        \
    do {                                                                                      \
        fix_crc((bytes), (n));                                                                \
        kt_program *q_ = NULL;                                                                \
        kt_status st_ = kt_program_load_memory((bytes), (n), &q_);                            \
        if (st_ == KT_OK)                                                                     \
            kt_program_destroy(q_);                                                           \
        TU_EXPECT_ERROR(st_, KT_EFORMAT, __VA_ARGS__);                                        \
    } while (0)

/* ---- damaged files ------------------------------------------------------------------------- */

static void test_truncated_and_flipped(void **state)
{
    (void)state;
    kt_program *p = compile_mlp();
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    kt_program *q = NULL;
    /* every length short of the whole file, each copied to a heap block of exactly that
     * size so that a read past the end is caught by the sanitizer */
    for (size_t len = 0; len < n; len++) {
        unsigned char *c = copy_of(bytes, len);
        kt_status st = kt_program_load_memory(c, len, &q);
        if (st != KT_EFORMAT)
            fail_msg("a file truncated to %zu of %zu bytes: status %d (%s)", len, n, st,
                     kt_last_error());
        free(c);
    }
    /* single-byte flips anywhere: caught by the header checks or the checksum */
    tu_rng r;
    tu_rng_seed(&r, 11);
    int by_crc = 0;
    for (int k = 0; k < 3000; k++) {
        unsigned char *c = copy_of(bytes, n);
        size_t at = (size_t)(tu_rng_next(&r) % n);
        c[at] ^= (unsigned char)(1 + tu_rng_next(&r) % 255);
        kt_status st = kt_program_load_memory(c, n, &q);
        if (st != KT_EFORMAT)
            fail_msg("byte %zu flipped: status %d (%s)", at, st, kt_last_error());
        by_crc += strstr(kt_last_error(), "checksum") != NULL;
        free(c);
    }
    assert_true(by_crc > 2500); /* most bytes are only covered by the checksum */

    unsigned char *c = copy_of(bytes, n);
    c[0] = 'X';
    TU_EXPECT_ERROR(kt_program_load_memory(c, n, &q), KT_EFORMAT, "bad magic");
    memcpy(c, bytes, n);
    wr_u32(c, H_VERSION, 11);
    fix_crc(c, n);
    TU_EXPECT_ERROR(kt_program_load_memory(c, n, &q), KT_EFORMAT, "version 11",
                    "reads versions 10 to 10");
    wr_u32(c, H_VERSION, 1);
    fix_crc(c, n);
    TU_EXPECT_ERROR(kt_program_load_memory(c, n, &q), KT_EFORMAT, "version 1");
    /* versions 3 to 9 have the attribute record before rope's, topk_router's,
     * sum/mean/expand/clamp's, attention's, moe's, cast's or cp_attention's fields: refused
     * by their version, not misread */
    for (uint32_t v = 3; v <= 9; v++) {
        char want[16];
        snprintf(want, sizeof want, "version %u", (unsigned)v);
        wr_u32(c, H_VERSION, v);
        fix_crc(c, n);
        TU_EXPECT_ERROR(kt_program_load_memory(c, n, &q), KT_EFORMAT, want);
    }
    memcpy(c, bytes, n);
    wr_u32(c, H_FLAGS, 0x10);
    fix_crc(c, n);
    TU_EXPECT_ERROR(kt_program_load_memory(c, n, &q), KT_EFORMAT, "unknown flags 0x10");
    free(c);

    /* trailing bytes: after the checksum, or inside a body whose size claims them */
    c = malloc(n + 8);
    assert_non_null(c);
    memcpy(c, bytes, n);
    memset(c + n, 0, 8);
    TU_EXPECT_ERROR(kt_program_load_memory(c, n + 1, &q), KT_EFORMAT, "truncated or padded");
    memcpy(c, bytes, n - 4);
    memset(c + n - 4, 0, 8);
    wr_u64(c, H_BODY, rd_u64(bytes, H_BODY) + 4);
    fix_crc(c, n + 4);
    TU_EXPECT_ERROR(kt_program_load_memory(c, n + 4, &q), KT_EFORMAT,
                    "name pool does not end the body");
    /* the unpatched bytes still load */
    OK(kt_program_load_memory(bytes, n, &q));
    kt_program_destroy(q);
    TU_EXPECT_ERROR(kt_program_load_memory(NULL, 0, &q), KT_EFORMAT, "too short");
    TU_EXPECT_ERROR(kt_program_load("/nonexistent/dir/x.ktp", &q), KT_EIO, "cannot open");
    free(c);
    free(bytes);
    kt_program_destroy(p);
}

static void test_corrupt_content_valid_checksum(void **state)
{
    (void)state;
    kt_program *p = compile_mlp();
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    layout L = find_layout(bytes, n);
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    assert_int_equal(L.n_bufs, st.n_buffers);
    assert_int_equal(L.n_steps, st.n_forward_steps + st.n_backward_steps);
    assert_int_equal(rd_u32(bytes, L.step[0] + S_OPLEN), 6);
    assert_memory_equal(bytes + L.step[0] + S_OPNAME, "matmul", 6);

    /* what the records say: step 0 is fc1 = matmul(x, w1) -> h0 */
    int32_t x = rd_i32(bytes, entry_at(&L, KT_ROLE_INPUT, 0, E_BUF));
    int32_t y = rd_i32(bytes, entry_at(&L, KT_ROLE_INPUT, 1, E_BUF));
    int32_t w1 = rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 0, E_BUF));
    int32_t h0 = rd_i32(bytes, step_at(&L, 0, S_OUT));
    assert_int_equal(rd_i32(bytes, step_at(&L, 0, S_IN)), x);
    assert_int_equal(rd_i32(bytes, step_at(&L, 0, S_IN + 4)), w1);
    assert_int_equal(rd_i32(bytes, buf_at(&L, x, B_REGION)), 0);
    assert_int_equal(rd_i32(bytes, buf_at(&L, w1, B_REGION)), 1);
    char want[96];
    unsigned char *c = malloc(n);
    assert_non_null(c);

    /* a buffer id out of range in a step */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 0, S_IN), L.n_bufs + 5);
    snprintf(want, sizeof want, "input buffer %d does not exist", L.n_bufs + 5);
    EXPECT_REJECTED(c, n, "step 0", want);
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 3, S_OUT), -1);
    EXPECT_REJECTED(c, n, "step 3", "output buffer -1 does not exist");

    /* a shape changed so that shape inference disagrees */
    memcpy(c, bytes, n);
    assert_int_equal(rd_u64(bytes, buf_at(&L, h0, B_SHAPE + 8)), MH);
    wr_u64(c, buf_at(&L, h0, B_SHAPE + 8), MH - 1);
    EXPECT_REJECTED(c, n, "step 0 (matmul)", "output 0 has the wrong shape");
    /* ... or made larger than the buffer's bytes */
    memcpy(c, bytes, n);
    wr_u64(c, buf_at(&L, h0, B_SHAPE + 8), MH + 1);
    snprintf(want, sizeof want, "buffer %d:", h0);
    EXPECT_REJECTED(c, n, want, "cannot hold its tensor");

    /* an offset pushed beyond its region */
    uint64_t arena = rd_u64(bytes, C_REGION);
    assert_int_equal(arena, st.arena_bytes);
    memcpy(c, bytes, n);
    wr_u64(c, buf_at(&L, y, B_OFFSET), arena + 64);
    snprintf(want, sizeof want, "buffer %d: offset %llu", y, (unsigned long long)arena + 64);
    EXPECT_REJECTED(c, n, want, "outside its", "region");
    memcpy(c, bytes, n);
    wr_u64(c, buf_at(&L, w1, B_OFFSET), rd_u64(bytes, C_REGION + 8));
    snprintf(want, sizeof want, "buffer %d: offset", w1);
    EXPECT_REJECTED(c, n, want, "outside its");

    /* a lifetime shortened so that a step uses a dead buffer: h0 is read by step 1 (bias) */
    int32_t first = rd_i32(bytes, buf_at(&L, h0, B_FIRST));
    int32_t last = rd_i32(bytes, buf_at(&L, h0, B_LAST));
    assert_int_equal(first, 0);
    assert_int_equal(last, 1);
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, h0, B_LAST), 0);
    snprintf(want, sizeof want, "step 1 uses buffer %d outside its lifetime [0, 0]", h0);
    EXPECT_REJECTED(c, n, want);
    /* the loss seed (a fill step) writing a buffer not yet alive */
    int32_t fill = st.n_forward_steps, seed = rd_i32(bytes, step_at(&L, fill, S_OUT));
    assert_int_equal(rd_i32(bytes, L.step[fill] + S_KIND), 2);
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, seed, B_FIRST), fill + 1);
    wr_i32(c, buf_at(&L, seed, B_LAST), fill + 1);
    snprintf(want, sizeof want, "step %d uses buffer %d outside its lifetime", fill, seed);
    EXPECT_REJECTED(c, n, want);
    /* an impossible lifetime */
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, h0, B_LAST), L.n_steps);
    snprintf(want, sizeof want, "buffer %d: invalid lifetime", h0);
    EXPECT_REJECTED(c, n, want);

    /* two buffers made to overlap in the activation region: y moved onto x (both inputs,
     * alive together from step 0, neither shared in place) */
    memcpy(c, bytes, n);
    assert_true(rd_u64(bytes, buf_at(&L, x, B_OFFSET)) != rd_u64(bytes, buf_at(&L, y, B_OFFSET)));
    wr_u64(c, buf_at(&L, y, B_OFFSET), rd_u64(bytes, buf_at(&L, x, B_OFFSET)));
    EXPECT_REJECTED(c, n, "overlap while both are alive");
    /* in-place sharing that does not share the memory */
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, y, B_STORAGE), x);
    snprintf(want, sizeof want, "buffer %d: inconsistent in-place sharing", y);
    EXPECT_REJECTED(c, n, want);

    /* an op this libkt does not have (same length, so the layout holds) */
    memcpy(c, bytes, n);
    c[L.step[0] + S_OPNAME + 5] = 'X';
    EXPECT_REJECTED(c, n, "step 0 uses op 'matmuX'", "does not have");
    /* a valid op that does not fit the step's tensors: concat(x, w1) in place of matmul */
    memcpy(c, bytes, n);
    memcpy(c + L.step[0] + S_OPNAME, "concat", 6);
    EXPECT_REJECTED(c, n, "step 0 (concat)");

    /* negative counts */
    memcpy(c, bytes, n);
    wr_i32(c, C_N_ENTRIES + 4, -1);
    EXPECT_REJECTED(c, n, "negative table size");
    memcpy(c, bytes, n);
    wr_i32(c, C_N_BUFS, -3);
    EXPECT_REJECTED(c, n, "table sizes exceed the file");
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 2, S_N_IN), -1);
    EXPECT_REJECTED(c, n, "step 2 has invalid counts");
    memcpy(c, bytes, n);
    wr_i32(c, C_N_FORWARD, L.n_steps + 1);
    EXPECT_REJECTED(c, n, "invalid table sizes");

    /* entries pointing at buffers in the wrong region */
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_INPUT, 0, E_BUF), w1);
    EXPECT_REJECTED(c, n, "input 0: buffer in the wrong region");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 0, E_BUF), x);
    EXPECT_REJECTED(c, n, "parameter 0: buffer in the wrong region");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 1, E_GRAD), w1);
    EXPECT_REJECTED(c, n, "parameter 1: invalid gradient buffer");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_OUTPUT, 0, E_BUF), L.n_bufs);
    EXPECT_REJECTED(c, n, "output 0: invalid entry");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 0, E_INIT), 9);
    EXPECT_REJECTED(c, n, "parameter 0: invalid initialiser");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_INPUT, 0, E_NAME), (int32_t)L.names_len);
    EXPECT_REJECTED(c, n, "input 0: invalid entry");

    /* a scratch id on a step kind that has no scratch (it was once used unchecked) */
    int32_t accum = L.n_steps - 1;
    assert_int_equal(rd_i32(bytes, L.step[accum] + S_KIND), 3);
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, accum, S_SCRATCH), INT32_MAX);
    snprintf(want, sizeof want, "step %d: bad accumulate step", accum);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, fill, S_SCRATCH), L.n_bufs + 1000);
    snprintf(want, sizeof want, "step %d: bad fill step", fill);
    EXPECT_REJECTED(c, n, want);
    /* a forward step's scratch out of range */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 1, S_SCRATCH), L.n_bufs);
    EXPECT_REJECTED(c, n, "step 1: scratch buffer", "does not exist");

    /* the loss pointing at a non-scalar; names not terminated; an invalid step kind */
    memcpy(c, bytes, n);
    wr_i32(c, C_LOSS, x);
    EXPECT_REJECTED(c, n, "invalid loss buffer");
    memcpy(c, bytes, n);
    c[L.names + L.names_len - 1] = 'z';
    EXPECT_REJECTED(c, n, "names are not terminated");
    memcpy(c, bytes, n);
    wr_i32(c, L.step[L.n_steps - 1] + S_KIND, 7);
    snprintf(want, sizeof want, "step %d: invalid kind 7", L.n_steps - 1);
    EXPECT_REJECTED(c, n, want);

    /* a region larger than its buffers reach: a session allocates every region whole (a
     * hand-edited 12 GiB arena for kilobytes of buffers), so the loader refuses it. A region
     * too large to allocate at all is a session's ENOMEM: test_huge_programs */
    static const char *const region_name[3] = {"activation", "parameter", "gradient"};
    const uint64_t larger[3] = {64, (uint64_t)12 << 30, UINT64_MAX - 63};
    for (int reg = 0; reg < 3; reg++) {
        uint64_t need = rd_u64(bytes, C_REGION + 8 * (size_t)reg);
        for (int k = 0; k < 3; k++) {
            uint64_t v = k == 0 ? need + larger[k] : larger[k];
            memcpy(c, bytes, n);
            wr_u64(c, C_REGION + 8 * (size_t)reg, v);
            snprintf(want, sizeof want, "the %s region is %llu bytes, its buffers need %llu",
                     region_name[reg], (unsigned long long)v, (unsigned long long)need);
            EXPECT_REJECTED(c, n, want);
        }
    }

    /* the unpatched copy loads (the patches above were the only damage) */
    memcpy(c, bytes, n);
    fix_crc(c, n);
    kt_program *q;
    OK(kt_program_load_memory(c, n, &q));
    kt_program_destroy(q);
    free(c);
    free(bytes);
    kt_program_destroy(p);
}

/* ---- hand-edited programs: every index and shape right, the data flow wrong --------------- */

/* Each edit below keeps every buffer id in range and every shape what shape inference says, so
 * the table checks above pass; yet a session running the program would give wrong numbers (or
 * waste memory) without an error. The loader refuses each, naming what is wrong and where.
 * The MLP's schedule (kt-graphc --print-plan of the same model):
 *    0 fc1 x,w1 -> h0    1 bias1 h0,b1 -> h1 (in place over h0)    2 act h1 -> h2
 *    3 fc2 h2,w2 -> logits    4 loss    5 fill (the loss seed)    6 backward of loss
 *    7 backward of fc2 (h2's gradient, gh2)  ...  12 backward of fc1    13 accumulate w1 */
static void test_hand_edited_programs(void **state)
{
    (void)state;
    kt_program *p = compile_mlp();
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    layout L = find_layout(bytes, n);
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    const int32_t nf = st.n_forward_steps, last = L.n_steps - 1;
    const int32_t x = rd_i32(bytes, entry_at(&L, KT_ROLE_INPUT, 0, E_BUF));
    const int32_t y = rd_i32(bytes, entry_at(&L, KT_ROLE_INPUT, 1, E_BUF));
    const int32_t w1 = rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 0, E_BUF));
    const int32_t b1 = rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 1, E_BUF));
    const int32_t gw1 = rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 0, E_GRAD));
    const int32_t gb1 = rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 1, E_GRAD));
    const int32_t h0 = rd_i32(bytes, step_at(&L, 0, S_OUT));
    const int32_t h1 = rd_i32(bytes, step_at(&L, 1, S_OUT));
    const int32_t h2 = rd_i32(bytes, step_at(&L, 2, S_OUT));
    const int32_t glogits = rd_i32(bytes, step_at(&L, nf + 1, S_GIN));
    const int32_t gh2 = rd_i32(bytes, step_at(&L, nf + 2, S_GIN));
    /* the schedule is as the comment says */
    assert_int_equal(nf, 5);
    assert_int_equal(rd_i32(bytes, L.step[nf] + S_KIND), 2);        /* fill */
    assert_int_equal(rd_i32(bytes, L.step[nf + 2] + S_KIND), 1);    /* backward of fc2 */
    assert_int_equal(rd_i32(bytes, step_at(&L, nf + 2, S_IN)), h2); /* it reads h2 last */
    assert_int_equal(rd_i32(bytes, buf_at(&L, h2, B_LAST)), nf + 2);
    assert_int_equal(rd_i32(bytes, L.step[last - 1] + S_KIND), 1); /* backward of fc1 */
    assert_int_equal(rd_i32(bytes, L.step[last] + S_KIND), 3);     /* accumulate w1 */
    assert_int_equal(rd_i32(bytes, buf_at(&L, h1, B_STORAGE)), h0);
    assert_int_equal(rd_i32(bytes, buf_at(&L, h0, B_LAST)), 1);
    assert_int_equal(rd_i32(bytes, buf_at(&L, h2, B_STORAGE)), h2);
    char want[160], want2[160];
    unsigned char *c = malloc(n);
    assert_non_null(c);

    /* an output pointed at a buffer that dies at step 1 (later steps reuse its memory) */
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_OUTPUT, 0, E_BUF), h0);
    snprintf(want, sizeof want, "buffer %d (output 'logits') lives from step 0 to 1", h0);
    snprintf(want2, sizeof want2, "must live to the last step (%d)", last);
    EXPECT_REJECTED(c, n, want, want2);
    /* ... or at one the backward schedule computes */
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_OUTPUT, 0, E_BUF), glogits);
    snprintf(want, sizeof want,
             "buffer %d (output 'logits') is computed by step %d, after the "
             "forward schedule (steps 0 to %d)",
             glogits, nf + 1, nf - 1);
    EXPECT_REJECTED(c, n, want);
    /* an input whose lifetime starts late: its memory could hold something else before */
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, y, B_FIRST), 1);
    snprintf(want, sizeof want, "buffer %d (input 'y') lives from step 1 to %d", y, last);
    EXPECT_REJECTED(c, n, want, "an input must live from step 0 to the last step");

    /* parameters (or gradients) placed on top of each other */
    memcpy(c, bytes, n);
    wr_u64(c, buf_at(&L, b1, B_OFFSET), rd_u64(bytes, buf_at(&L, w1, B_OFFSET)));
    snprintf(want, sizeof want,
             "buffer %d (parameter 'w1') and buffer %d (parameter 'b1') "
             "overlap in the parameter region",
             w1, b1);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_u64(c, buf_at(&L, gb1, B_OFFSET), rd_u64(bytes, buf_at(&L, gw1, B_OFFSET)));
    /* (named in the order of their offsets) */
    char want_w1[96], want_b1[96];
    snprintf(want_w1, sizeof want_w1, "buffer %d (the gradient of parameter 'w1')", gw1);
    snprintf(want_b1, sizeof want_b1, "buffer %d (the gradient of parameter 'b1')", gb1);
    EXPECT_REJECTED(c, n, want_w1, want_b1, "overlap in the gradient region");

    /* the loss seed written into input x: the backward reads a seed nothing writes */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, nf, S_OUT), x);
    snprintf(want, sizeof want,
             "step %d (fill) writes buffer %d (input 'x'), which only the caller writes", nf, x);
    EXPECT_REJECTED(c, n, want);
    /* a backward step writing a parameter (fc1's weight gradient into w1 itself) */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, last - 1, S_GIN + 4), w1);
    snprintf(want, sizeof want,
             "step %d (backward matmul 'fc1') writes buffer %d (parameter "
             "'w1'), which only the caller writes",
             last - 1, w1);
    EXPECT_REJECTED(c, n, want);
    /* a step reading what a later step writes (h2, its lifetime stretched to match) */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 1, S_IN), h2);
    wr_i32(c, buf_at(&L, h2, B_FIRST), 1);
    snprintf(want, sizeof want,
             "step 1 (forward add 'bias1') reads buffer %d, which no earlier step writes", h2);
    EXPECT_REJECTED(c, n, want);
    /* two steps writing one buffer */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 2, S_OUT), h1);
    snprintf(want, sizeof want,
             "step 2 (forward silu 'act') writes buffer %d, which step 1 writes already", h1);
    EXPECT_REJECTED(c, n, want);
    /* a buffer holding data given to a step as its scratch */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, 1, S_SCRATCH), h0);
    snprintf(want, sizeof want,
             "step 1 (forward add 'bias1') uses buffer %d as scratch, but it holds data", h0);
    EXPECT_REJECTED(c, n, want);
    /* a step reading a gradient (which the optimizer alone reads) */
    memcpy(c, bytes, n);
    wr_i32(c, step_at(&L, last, S_IN), gw1);
    snprintf(want, sizeof want,
             "step %d (accumulate 'w1') reads buffer %d (the gradient of "
             "parameter 'w1'), a gradient",
             last, gw1);
    EXPECT_REJECTED(c, n, want);

    /* the forward schedule: empty, holding the loss seed, or missing the loss */
    memcpy(c, bytes, n);
    wr_i32(c, C_N_FORWARD, 0);
    snprintf(want, sizeof want, "n_forward is 0 but the program has %d steps", L.n_steps);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_i32(c, C_N_FORWARD, nf + 1);
    snprintf(want, sizeof want, "step %d: a fill step inside the forward schedule (steps 0 to %d)",
             nf, nf);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_i32(c, C_N_FORWARD, nf - 1);
    snprintf(want, sizeof want, "(the loss) is computed by step %d, after the forward schedule",
             nf - 1);
    EXPECT_REJECTED(c, n, want);
    /* a backward schedule with no loss to differentiate, or a seed other than 1 */
    memcpy(c, bytes, n);
    wr_i32(c, C_LOSS, -1);
    EXPECT_REJECTED(c, n, "does not start with the seed of a loss's gradient");
    memcpy(c, bytes, n);
    wr_u32(c, step_at(&L, nf, S_ATTRS + 8), 0x40000000u); /* alpha = 2.0f */
    snprintf(want, sizeof want, "step %d: fill value 2, not 0 or 1", nf);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_u32(c, step_at(&L, nf, S_ATTRS + 8), 0); /* a seed of 0: every gradient 0 */
    EXPECT_REJECTED(c, n, "does not start with the seed of a loss's gradient");

    /* in-place sharing: h1 takes h0's memory at step 1, so h0 may not live past it ... */
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, h0, B_LAST), 2);
    snprintf(want, sizeof want,
             "buffers %d and %d share memory in place while both are alive at step 1", h0, h1);
    EXPECT_REJECTED(c, n, want);
    /* ... and only a forward step that computes in place may hand memory over: the backward
     * of fc2 writes gh2 while it reads h2 */
    memcpy(c, bytes, n);
    wr_i32(c, buf_at(&L, gh2, B_STORAGE), h2);
    wr_u64(c, buf_at(&L, gh2, B_OFFSET), rd_u64(bytes, buf_at(&L, h2, B_OFFSET)));
    snprintf(want, sizeof want,
             "buffer %d takes the memory of buffer %d at step %d, which does "
             "not compute it in place",
             gh2, h2, nf + 2);
    EXPECT_REJECTED(c, n, want);

    /* names and buffers the caller reaches tensors by */
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 1, E_NAME),
           rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 0, E_NAME)));
    EXPECT_REJECTED(c, n, "input or parameter name 'w1' is used twice");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 0, E_NAME),
           rd_i32(bytes, entry_at(&L, KT_ROLE_PARAM, 0, E_NAME)) + 1);
    EXPECT_REJECTED(c, n, "parameter 0: invalid entry", "is not the start of a name");
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_INPUT, 1, E_BUF), x);
    snprintf(want, sizeof want, "inputs 'x' and 'y' share buffer %d", x);
    EXPECT_REJECTED(c, n, want);
    memcpy(c, bytes, n);
    wr_i32(c, entry_at(&L, KT_ROLE_PARAM, 0, E_GRAD), -1); /* accumulated, never used */
    snprintf(want, sizeof want, "buffer %d is in the gradient region but belongs to no parameter",
             gw1);
    EXPECT_REJECTED(c, n, want);

    /* numbers that are statistics or initialisers, out of their range */
    memcpy(c, bytes, n);
    wr_u32(c, entry_at(&L, KT_ROLE_PARAM, 0, E_A), 0x7fc00000u); /* normal(NaN) */
    EXPECT_REJECTED(c, n, "parameter 0: invalid initialiser");
    memcpy(c, bytes, n);
    wr_u64(c, step_at(&L, 0, S_FLOPS), 0x7ff8000000000000ull);
    EXPECT_REJECTED(c, n, "step 0: invalid FLOP count");
    memcpy(c, bytes, n);
    wr_u64(c, C_LOWER, rd_u64(bytes, C_LOWER) + 64);
    snprintf(want, sizeof want, "the lower bound says %llu bytes, the buffers' lifetimes give %llu",
             (unsigned long long)st.lower_bound_bytes + 64,
             (unsigned long long)st.lower_bound_bytes);
    EXPECT_REJECTED(c, n, want);

    /* the unpatched copy loads */
    memcpy(c, bytes, n);
    kt_program *q;
    OK(kt_program_load_memory(c, n, &q));
    kt_program_destroy(q);
    free(c);
    free(bytes);
    kt_program_destroy(p);
}

/* ---- program files: directories, pipes, devices, sizes --------------------------------------- */

/* Writes n bytes into a new pipe (they fit its buffer) and returns its read end. */
static int pipe_with(const void *bytes, size_t n)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    assert_true(n <= 65536);
    assert_int_equal(write(fds[1], bytes, n), (ssize_t)n);
    close(fds[1]);
    return fds[0];
}

static void test_program_files(void **state)
{
    (void)state;
    kt_program *p = compile_mlp(), *q = NULL;
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    char path[64];

    /* a directory says so (it used to read as a file of LONG_MAX bytes) */
    char dir[] = "/tmp/kt_test_program_XXXXXX";
    assert_non_null(mkdtemp(dir));
    TU_EXPECT_ERROR(kt_program_load(dir, &q), KT_EIO, dir, "Is a directory");

    /* a pipe is read as a stream (kt-run <(...)), and gives the same program */
    int fd = pipe_with(bytes, n);
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    OK(kt_program_load(path, &q));
    close(fd);
    char *a = describe(p), *b = describe(q);
    assert_string_equal(a, b);
    free(a);
    free(b);
    kt_program_destroy(q);
    /* ... with the usual errors: padded, truncated, a body larger than any program */
    unsigned char *c = malloc(n + 1);
    assert_non_null(c);
    memcpy(c, bytes, n);
    c[n] = 0;
    fd = pipe_with(c, n + 1);
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    TU_EXPECT_ERROR(kt_program_load(path, &q), KT_EFORMAT, path, "truncated or padded");
    close(fd);
    fd = pipe_with(bytes, n / 2);
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    TU_EXPECT_ERROR(kt_program_load(path, &q), KT_EFORMAT, path, "truncated or padded");
    close(fd);
    wr_u64(c, H_BODY, (uint64_t)1 << 40);
    fd = pipe_with(c, 24);
    snprintf(path, sizeof path, "/dev/fd/%d", fd);
    TU_EXPECT_ERROR(kt_program_load(path, &q), KT_EFORMAT, "declares a 1099511627776-byte body",
                    "more than a program file holds");
    close(fd);
    /* a device is refused (one that never ends used to be read, one that waits to block) */
    TU_EXPECT_ERROR(kt_program_load("/dev/zero", &q), KT_EINVAL, "/dev/zero", "character device");
    /* a named FIFO nobody writes is refused at once (open() used to wait for a writer) */
    char fifo[128];
    snprintf(fifo, sizeof fifo, "%s/fifo.ktp", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    TU_EXPECT_ERROR(kt_program_load(fifo, &q), KT_EINVAL, fifo, "FIFO");
    assert_int_equal(unlink(fifo), 0);

    /* a regular file larger than any program (sparse: no disk used) is refused unread */
    char big[] = "/tmp/kt_test_program_big_XXXXXX";
    int bfd = mkstemp(big);
    assert_true(bfd >= 0);
    assert_int_equal(ftruncate(bfd, ((off_t)1 << 30) + 1), 0);
    close(bfd);
    TU_EXPECT_ERROR(kt_program_load(big, &q), KT_EFORMAT, "1073741825 bytes",
                    "more than a program file holds");
    unlink(big);
    rmdir(dir);
    free(c);
    free(bytes);
    kt_program_destroy(p);
}

/* Programs that are valid but whose regions no machine can allocate (2^59-byte tensors): the
 * session says so. One has no steps at all (its output is a parameter), which loads too. */
static void test_huge_programs(void **state)
{
    (void)state;
    const int64_t shape[2] = {(int64_t)1 << 29, (int64_t)1 << 28};
    for (int k = 0; k < 2; k++) {
        kt_graph *g;
        kt_value v;
        OK(kt_graph_create(&g));
        if (k == 0) {
            OK(kt_graph_input(g, "x", KT_F32, 2, shape, &v));
            v = tu_op1(g, "act", KT_OP_SILU, NULL, v);
        } else {
            OK(kt_graph_param(g, "w", KT_F32, 2, shape, kt_init_zeros(), &v));
        }
        OK(kt_graph_output(g, v, "y"));
        kt_program *p, *q;
        OK(kt_compile(g, NULL, &p));
        kt_program_stats st;
        kt_program_get_stats(p, &st);
        assert_int_equal(st.n_forward_steps, k == 0 ? 1 : 0);
        assert_int_equal(st.n_backward_steps, 0);
        size_t n;
        unsigned char *bytes = serialize(p, &n);
        OK(kt_program_load_memory(bytes, n, &q));
        kt_session *s;
        kt_session_options so = {.threads = 1};
        /* refused by the admission check, before any region is allocated */
        TU_EXPECT_ERROR(kt_session_create(q, &so, &s), KT_ENOMEM, "memory plan needs",
                        "is available");
        free(bytes);
        kt_program_destroy(q);
        kt_program_destroy(p);
        kt_graph_destroy(g);
    }
}

/* The fields of the file: offset and width (1, 4 or 8 bytes). */
typedef struct field {
    size_t at;
    int width;
} field;

/* core_only: just the fields that reference or size something (counts, buffers, the used
 * slots of steps, entries), where damage must be caught rather than shrugged off. */
static int list_fields(const unsigned char *b0, const layout *L, int core_only, field *f,
                       int cap)
{
    int n = 0;
#define ADD(a, w)                                                                             \
    do {                                                                                      \
        if (n < cap)                                                                          \
            f[n++] = (field){(a), (w)};                                                       \
    } while (0)
    for (size_t a = C_N_BUFS; a < C_REGION; a += 4)
        ADD(a, 4);
    for (size_t a = C_REGION; a < (core_only ? C_LOWER : C_END); a += 8)
        ADD(a, 8);
    for (int32_t i = 0; i < L->n_bufs; i++) {
        size_t b = C_END + (size_t)i * B_SIZE;
        ADD(b + B_DTYPE, 4);
        ADD(b + B_NDIM, 4);
        for (int d = 0; d < 4; d++)
            ADD(b + B_SHAPE + 8 * (size_t)d, 8);
        ADD(b + B_REGION, 4);
        ADD(b + B_OFFSET, 8);
        ADD(b + B_BYTES, 8);
        ADD(b + B_FIRST, 4);
        ADD(b + B_LAST, 4);
        ADD(b + B_STORAGE, 4);
    }
    static const int attr_width[] = {4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 8, 8, 4, 4, 4, 8, 8, 8, 8, 4,
                                     8, 8, 4, 4, 4, 4, 4, 8, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                     4, 4, 4, 8, 4, 4, 4, 4, 8, 4, 8, 4, 4, 4};
    for (int32_t i = 0; i < L->n_steps && core_only; i++) {
        size_t base = L->fields[i];
        int32_t n_in = rd_i32(b0, base + S_N_IN), n_out = rd_i32(b0, base + S_N_OUT);
        ADD(L->step[i] + S_KIND, 4);
        ADD(base + S_N_IN, 4);
        ADD(base + S_N_OUT, 4);
        for (int32_t k = 0; k < n_in; k++) {
            ADD(base + S_IN + 4 * (size_t)k, 4);
            ADD(base + S_GIN + 4 * (size_t)k, 4);
        }
        for (int32_t k = 0; k < n_out; k++) {
            ADD(base + S_OUT + 4 * (size_t)k, 4);
            ADD(base + S_GOUT + 4 * (size_t)k, 4);
        }
        ADD(base + S_SCRATCH, 4);
    }
    for (int32_t i = 0; i < L->n_steps && !core_only; i++) {
        ADD(L->step[i] + S_KIND, 4);
        for (size_t a = L->step[i] + S_OPNAME; a < L->fields[i]; a++)
            ADD(a, 1);
        size_t a = L->fields[i];
        for (size_t k = 0; k < sizeof attr_width / sizeof attr_width[0]; k++) {
            ADD(a, attr_width[k]);
            a += (size_t)attr_width[k];
        }
        assert_int_equal(a, L->fields[i] + S_N_IN);
        for (; a < L->fields[i] + S_FLOPS; a += 4)
            ADD(a, 4);
        ADD(a, 8);
    }
    for (int r = 0; r < 3; r++)
        for (int32_t i = 0; i < L->n_entries[r]; i++)
            for (size_t k = 0; k < (core_only ? (size_t)E_INIT : (size_t)E_SIZE); k += 4)
                ADD(entry_at(L, r, i, k), 4);
    for (size_t a = L->names; a < L->names + L->names_len && !core_only; a++)
        ADD(a, 1);
#undef ADD
    return n;
}

static void mutate(unsigned char *c, const field *f, tu_rng *r, int32_t n_bufs)
{
    uint64_t pick = tu_rng_next(r) % 8;
    if (f->width == 1) {
        c[f->at] = (unsigned char)tu_rng_next(r);
    } else if (f->width == 4) {
        int32_t v = rd_i32(c, f->at);
        static const int32_t special[] = {-1, 0, 1, 2, INT32_MAX, INT32_MIN, -2, 64};
        switch (pick) {
        case 0: case 1: case 2:
            v = (int32_t)((uint32_t)v + (uint32_t)(tu_rng_next(r) % 7) - 3u); /* wraps */
            break;
        case 3: case 4:
            v = (int32_t)(tu_rng_next(r) % (uint64_t)(n_bufs + 4)) - 2;
            break;
        case 5:
            v = (int32_t)(uint32_t)tu_rng_next(r);
            break;
        default:
            v = special[tu_rng_next(r) % 8];
            break;
        }
        wr_i32(c, f->at, v);
    } else {
        uint64_t v = rd_u64(c, f->at);
        switch (pick) {
        case 0: case 1:
            v += 64 * ((tu_rng_next(r) % 5) - 2);
            break;
        case 2:
            v += (tu_rng_next(r) % 7) - 3;
            break;
        case 3:
            v *= 2;
            break;
        case 4:
            v = tu_rng_next(r);
            break;
        case 5:
            v = 0;
            break;
        case 6:
            v = UINT64_MAX - (tu_rng_next(r) % 3);
            break;
        default:
            v ^= 1ull << (tu_rng_next(r) % 64);
            break;
        }
        wr_u64(c, f->at, v);
    }
}

#if defined(TEST_ASAN)
/* A damaged program may ask for absurd region sizes; the session must report ENOMEM, which
 * needs the sanitizer's allocator to return NULL rather than abort. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }
#endif

enum { N_MUTATIONS = 20000 };

static void test_random_field_mutations(void **state)
{
    (void)state;
    kt_threadpool *pool;
    OK(kt_threadpool_create(2, &pool));
    kt_program *p = compile_mlp();
    size_t n;
    unsigned char *bytes = serialize(p, &n);
    layout L = find_layout(bytes, n);
    if (getenv("KT_TEST_VERBOSE"))
        OK(kt_program_save(p, "/tmp/kt_mlp_debug.ktp"));
    static field all[8192], core[8192];
    int n_all = list_fields(bytes, &L, 0, all, 8192);
    int n_core = list_fields(bytes, &L, 1, core, 8192);
    assert_true(n_all > 100 && n_all < 8192);
    assert_true(n_core > 100 && n_core < n_all);
    unsigned char *c = malloc(n);
    assert_non_null(c);
    tu_rng r;
    /* KT_TEST_FUZZ_SEED picks another sequence (KT_TEST_VERBOSE prints each mutation) */
    const char *seed = getenv("KT_TEST_FUZZ_SEED");
    tu_rng_seed(&r, seed != NULL ? strtoull(seed, NULL, 10) : 99);
    int loaded = 0, sessions = 0, forward_ok = 0, forward_err = 0, rejected_core = 0;
    for (int it = 0; it < N_MUTATIONS; it++) {
        memcpy(c, bytes, n);
        int k = 1 + (tu_rng_next(&r) % 4 == 0 ? (int)(tu_rng_next(&r) % 3) : 0);
        int use_core = it % 2;
        for (int m = 0; m < k; m++) {
            const field *fd = use_core ? &core[tu_rng_next(&r) % (uint64_t)n_core]
                                       : &all[tu_rng_next(&r) % (uint64_t)n_all];
            mutate(c, fd, &r, L.n_bufs);
            if (getenv("KT_TEST_VERBOSE"))
                fprintf(stderr, "it %d: field at %zu (width %d) -> %lld\n", it, fd->at,
                        fd->width, fd->width == 8 ? (long long)rd_u64(c, fd->at)
                                   : fd->width == 4 ? (long long)rd_i32(c, fd->at)
                                                    : (long long)c[fd->at]);
        }
        fix_crc(c, n);
        kt_program *q = NULL;
        kt_status st = kt_program_load_memory(c, n, &q);
        if (st != KT_OK) {
            rejected_core += use_core;
            if (st != KT_EFORMAT)
                fail_msg("mutation %d: status %d (%s)", it, st, kt_last_error());
            assert_true(kt_last_error()[0] != '\0');
            continue;
        }
        loaded++;
        kt_program_stats qs;
        kt_program_get_stats(q, &qs);
        /* the plan of what loaded is sound: describing it touches every table */
        char *text = describe(q);
        free(text);
        /* (absurd region sizes are tested on their own: here they would only spend time) */
        if (qs.arena_bytes < (64u << 20) && qs.param_bytes < (64u << 20) &&
            qs.grad_bytes < (64u << 20)) {
            kt_session_options so = {.pool = pool, .seed = 1,
                                     .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 1e-3f}};
            kt_session *s;
            if (kt_session_create(q, &so, &s) == KT_OK) {
                sessions++;
                if (fill_inputs(s, q, 5) && kt_session_forward(s) == KT_OK) {
                    forward_ok++;
                    if (kt_session_backward(s) == KT_OK)
                        (void)kt_session_step(s);
                } else {
                    forward_err++;
                }
                kt_session_destroy(s);
            }
        }
        kt_program_destroy(q);
    }
    print_message("%d field mutations with a valid checksum (half in referencing fields, "
                  "%d of those rejected): %d loaded, %d sessions, %d forwards ran, %d failed "
                  "cleanly\n", N_MUTATIONS, rejected_core, loaded, sessions, forward_ok,
                  forward_err);
    /* harmless fields (FLOP counts, initialiser parameters, names' bytes) change without
     * breaking anything, so some do load and run */
    assert_true(loaded > 0 && forward_ok > 0);
    assert_true(loaded < N_MUTATIONS && rejected_core > N_MUTATIONS / 4);
    free(c);
    free(bytes);
    kt_program_destroy(p);
    kt_threadpool_destroy(pool);
}

/* ---- no allocation while running ----------------------------------------------------------- */

static void test_zero_allocations(void **state)
{
    (void)state;
#ifdef TEST_ASAN
    print_message("skipped: the allocation counter replaces malloc, which AddressSanitizer "
                  "owns in this build\n");
    skip();
#else
    kt_threadpool *pool;
    OK(kt_threadpool_create(2, &pool)); /* creating a pool allocates: done before counting */
    kt_program *p = compile_mlp();
    kt_session_options so = {.pool = pool, .seed = 3,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 1e-2f,
                                           .weight_decay = 0.01f, .clip_norm = 1.0f,
                                           .schedule = KT_LR_COSINE, .warmup_steps = 2,
                                           .total_steps = 10}};
    kt_session *s;
    /* the counter sees the library's own calls: creating a session allocates its regions
     * (posix_memalign) and tables (calloc) */
    atomic_store(&alloc_count, 0);
    atomic_store(&alloc_counting, 1);
    kt_status created = kt_session_create(p, &so, &s);
    atomic_store(&alloc_counting, 0);
    OK(created);
    assert_true(atomic_load(&alloc_count) >= 6);
    assert_true(fill_inputs(s, p, 8));

    /* and direct calls: one malloc and one free through pointers the compiler cannot see */
    void *(*volatile do_malloc)(size_t) = malloc;
    void (*volatile do_free)(void *) = free;
    atomic_store(&alloc_count, 0);
    atomic_store(&alloc_counting, 1);
    void *probe = do_malloc(32);
    do_free(probe);
    atomic_store(&alloc_counting, 0);
    assert_int_equal(atomic_load(&alloc_count), 2);

    float losses[4];
    atomic_store(&alloc_count, 0);
    atomic_store(&alloc_counting, 1);
    kt_status st = KT_OK;
    for (int k = 0; k < 4 && st == KT_OK; k++) {
        st = kt_session_forward(s);
        if (st == KT_OK)
            st = kt_session_backward(s);
        if (st == KT_OK)
            st = kt_session_step(s);
        losses[k] = kt_session_loss(s);
    }
    atomic_store(&alloc_counting, 0);
    OK(st);
    long count = atomic_load(&alloc_count);
    if (count != 0)
        fail_msg("%ld heap allocations during forward/backward/step", count);
    /* it really trained: the loss went down on the fixed batch */
    for (int k = 0; k < 4; k++)
        assert_true(isfinite(losses[k]));
    assert_true(losses[3] < losses[0]);
    assert_int_equal(kt_session_step_count(s), 4);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_threadpool_destroy(pool);
#endif
}

/* ---- bad builds ---------------------------------------------------------------------------- */

static void test_bad_builds(void **state)
{
    (void)state;
    kt_graph *g;
    kt_value x, y, w, ci, h, out, scalar_in;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(4, 8), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(4), &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, TU_SHAPE(8, 3), kt_init_normal(0.1f), &w));
    h = tu_op2(g, "proj", KT_OP_MATMUL, NULL, x, w); /* node 0 */

    /* wrong shapes: [4,8] x [4,8]; the message names the node index, op and name */
    kt_value in[2] = {x, x};
    TU_EXPECT_ERROR(kt_graph_op(g, "oops", KT_OP_MATMUL, NULL, in, 2, &out), KT_EINVAL,
                    "node 1", "matmul", "'oops'");
    in[0] = h;
    in[1] = x; /* add: [4,3] + [4,8] */
    TU_EXPECT_ERROR(kt_graph_op(g, NULL, KT_OP_ADD, NULL, in, 2, &out), KT_EINVAL,
                    "node 1 (add)");
    /* wrong arity and invalid ops */
    TU_EXPECT_ERROR(kt_graph_op(g, "one", KT_OP_MATMUL, NULL, in, 1, &out), KT_EINVAL,
                    "node 1", "matmul");
    TU_EXPECT_ERROR(kt_graph_op(g, "bad", (kt_op)KT_OP_COUNT, NULL, in, 2, &out), KT_EINVAL,
                    "node 1", "invalid op");
    /* a value id that is not in the graph */
    in[0] = (kt_value){999};
    TU_EXPECT_ERROR(kt_graph_op(g, "ghost", KT_OP_SILU, NULL, in, 1, &out), KT_EINVAL,
                    "node 1 (silu 'ghost')", "input 0", "id 999");
    in[0] = (kt_value){-1};
    TU_EXPECT_ERROR(kt_graph_op(g, "ghost", KT_OP_SILU, NULL, in, 1, &out), KT_EINVAL,
                    "id -1");
    TU_EXPECT_ERROR(kt_graph_output(g, (kt_value){999}, "o"), KT_EINVAL, "output 'o'",
                    "id 999");
    TU_EXPECT_ERROR(kt_graph_set_loss(g, (kt_value){42}), KT_EINVAL, "loss", "id 42");
    kt_tensor meta;
    TU_EXPECT_ERROR(kt_graph_value_meta(g, (kt_value){42}, &meta), KT_EINVAL, "invalid");
    /* nothing was added by the failures */
    assert_int_equal(kt_graph_node_count(g), 1);

    /* duplicate names among inputs and parameters */
    kt_value v;
    TU_EXPECT_ERROR(kt_graph_input(g, "x", KT_F32, 1, TU_SHAPE(2), &v), KT_EINVAL, "input 'x'",
                    "already taken");
    TU_EXPECT_ERROR(kt_graph_param(g, "x", KT_F32, 1, TU_SHAPE(2), kt_init_zeros(), &v),
                    KT_EINVAL, "param 'x'", "already taken");
    TU_EXPECT_ERROR(kt_graph_input(g, "w", KT_F32, 1, TU_SHAPE(2), &v), KT_EINVAL, "'w'",
                    "already taken");
    TU_EXPECT_ERROR(kt_graph_const_param(g, "w", KT_BF16, 1, TU_SHAPE(2), kt_init_zeros(), &v),
                    KT_EINVAL, "'w'", "already taken");
    /* duplicate output name */
    OK(kt_graph_output(g, h, "proj_out"));
    TU_EXPECT_ERROR(kt_graph_output(g, x, "proj_out"), KT_EINVAL, "output 'proj_out'",
                    "already taken");
    /* empty, NULL and too long names */
    char longname[200];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    TU_EXPECT_ERROR(kt_graph_input(g, "", KT_F32, 1, TU_SHAPE(2), &v), KT_EINVAL,
                    "a name is required");
    TU_EXPECT_ERROR(kt_graph_input(g, NULL, KT_F32, 1, TU_SHAPE(2), &v), KT_EINVAL,
                    "a name is required");
    TU_EXPECT_ERROR(kt_graph_param(g, longname, KT_F32, 1, TU_SHAPE(2), kt_init_zeros(), &v),
                    KT_EINVAL, "longer than 127 bytes");
    TU_EXPECT_ERROR(kt_graph_output(g, h, ""), KT_EINVAL, "output", "a name is required");
    TU_EXPECT_ERROR(kt_graph_output(g, h, NULL), KT_EINVAL, "a name is required");
    TU_EXPECT_ERROR(kt_graph_output(g, h, longname), KT_EINVAL, "longer than 127 bytes");
    TU_EXPECT_ERROR(kt_graph_op(g, longname, KT_OP_SILU, NULL, &h, 1, &out), KT_EINVAL,
                    "node 1", "longer than 127 bytes");
    /* 127 bytes is still fine */
    longname[127] = '\0';
    OK(kt_graph_input(g, longname, KT_F32, 1, TU_SHAPE(2), &v));
    /* a trainable parameter that is not f32 (a frozen one may be) */
    TU_EXPECT_ERROR(kt_graph_param(g, "wb", KT_BF16, 1, TU_SHAPE(2), kt_init_zeros(), &v),
                    KT_EINVAL, "param 'wb'", "f32", "bf16");
    TU_EXPECT_ERROR(kt_graph_param(g, "wi", KT_I32, 1, TU_SHAPE(2), kt_init_zeros(), &v),
                    KT_EINVAL, "param 'wi'", "i32");
    OK(kt_graph_const_param(g, "frozen", KT_BF16, 2, TU_SHAPE(8, 3), kt_init_normal(0.1f),
                            &ci));
    /* a bad shape or initialiser */
    TU_EXPECT_ERROR(kt_graph_input(g, "neg", KT_F32, 1, TU_SHAPE(-2), &v), KT_EINVAL,
                    "input 'neg'");
    TU_EXPECT_ERROR(kt_graph_param(g, "u", KT_F32, 1, TU_SHAPE(2), kt_init_uniform(1, 1), &v),
                    KT_EINVAL, "param 'u'", "invalid initialiser");

    /* losses: not a scalar, an integer, an input */
    TU_EXPECT_ERROR(kt_graph_set_loss(g, h), KT_EINVAL, "scalar f32", "f32[4,3]");
    OK(kt_graph_input(g, "scalar", KT_F32, 0, NULL, &scalar_in));
    TU_EXPECT_ERROR(kt_graph_set_loss(g, scalar_in), KT_EINVAL, "computed by an op");
    kt_op_attrs rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 0);
    kt_value int_scalar;
    kt_value y1;
    kt_op_attrs nar = TU_ATTRS(KT_OP_NARROW, .dim = 0, .start = 0, .length = 1);
    OK(kt_graph_op(g, NULL, KT_OP_NARROW, &nar, &y, 1, &y1));
    OK(kt_graph_op(g, NULL, KT_OP_RESHAPE, &rs, &y1, 1, &int_scalar));
    TU_EXPECT_ERROR(kt_graph_set_loss(g, int_scalar), KT_EINVAL, "scalar f32", "i32");

    /* compiling for training without a loss */
    kt_program *p = NULL;
    kt_compile_options train = {.training = 1};
    TU_EXPECT_ERROR(kt_compile(g, &train, &p), KT_EINVAL, "training needs a loss");
    /* but forward-only is fine (options NULL: training only when there is a loss) */
    OK(kt_compile(g, NULL, &p));
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    assert_int_equal(st.n_backward_steps, 0);
    assert_int_equal(st.n_forward_steps, 1); /* proj; the unused narrow/reshape are dropped */
    kt_program_destroy(p);

    kt_graph_destroy(g);

    /* a loss that depends on no trainable parameter */
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(4, 8), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(4), &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, TU_SHAPE(8, 3), kt_init_normal(0.1f), &w));
    OK(kt_graph_param(g, "w_unused", KT_F32, 2, TU_SHAPE(8, 3), kt_init_normal(0.1f), &ci));
    h = tu_op2(g, "proj", KT_OP_MATMUL, NULL, x, w);
    kt_value loss = tu_op2(g, "ce", KT_OP_CROSS_ENTROPY, NULL, h, y);
    /* the loss of an input-only computation: CE(x[:, :3], y) */
    kt_op_attrs n3 = TU_ATTRS(KT_OP_NARROW, .dim = 1, .start = 0, .length = 3);
    kt_value x3 = tu_op1(g, "x3", KT_OP_NARROW, &n3, x);
    kt_value loss_x = tu_op2(g, "ce_x", KT_OP_CROSS_ENTROPY, NULL, x3, y);
    OK(kt_graph_set_loss(g, loss_x));
    TU_EXPECT_ERROR(kt_compile(g, NULL, &p), KT_EINVAL, "does not depend on any trainable");
    TU_EXPECT_ERROR(kt_compile(g, &train, &p), KT_EINVAL, "does not depend on any trainable");
    /* forward only, it compiles */
    kt_compile_options fwd = {.training = 0};
    OK(kt_compile(g, &fwd, &p));
    kt_program_destroy(p);
    /* with the real loss it trains */
    OK(kt_graph_set_loss(g, loss));
    OK(kt_compile(g, NULL, &p));
    kt_program_get_stats(p, &st);
    assert_true(st.n_backward_steps > 0);
    /* w_unused gets no gradient and is not updated (as PyTorch skips a .grad of None) */
    assert_int_equal(kt_program_count(p, KT_ROLE_GRAD), 1);
    kt_program_destroy(p);
    kt_graph_destroy(g);

    /* no outputs and no loss */
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(4, 8), &x));
    (void)tu_op1(g, "a", KT_OP_SILU, NULL, x);
    kt_compile_options none = {.training = 0};
    TU_EXPECT_ERROR(kt_compile(g, &none, &p), KT_EINVAL, "no outputs and no loss");
    TU_EXPECT_ERROR(kt_compile(g, NULL, &p), KT_EINVAL, "no outputs and no loss");
    TU_EXPECT_ERROR(kt_compile(NULL, NULL, &p), KT_EINVAL, "NULL");
    kt_graph_destroy(g);
}

/* ---- compile options ----------------------------------------------------------------------- */

static int describe_has(const kt_program *p, const char *what)
{
    char *text = describe(p);
    int found = strstr(text, what) != NULL;
    free(text);
    return found;
}

/* loss = CE((x W + x W) V, y) with the matmul written twice, plus two scales that differ only
 * in alpha (never merged) and a dead branch */
static kt_graph *build_duplicates(void)
{
    kt_graph *g;
    kt_value x, x_unused, y, w, v, a, b, s, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(8, 16), &x));
    OK(kt_graph_input(g, "x_unused", KT_F32, 2, TU_SHAPE(8, 16), &x_unused));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(8), &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, TU_SHAPE(16, 16), kt_init_normal(0.2f), &w));
    OK(kt_graph_param(g, "v", KT_F32, 2, TU_SHAPE(16, 5), kt_init_normal(0.2f), &v));
    a = tu_op2(g, "mm_a", KT_OP_MATMUL, NULL, x, w);
    b = tu_op2(g, "mm_b", KT_OP_MATMUL, NULL, x, w);
    s = tu_op2(g, "sum", KT_OP_ADD, NULL, a, b);
    kt_value s1 = tu_op1(g, "half", KT_OP_SCALE, &TU_ATTRS(KT_OP_SCALE, .alpha = 0.5f), s);
    kt_value s2 = tu_op1(g, "third", KT_OP_SCALE, &TU_ATTRS(KT_OP_SCALE, .alpha = 1.0f / 3), s);
    s = tu_op2(g, "both", KT_OP_ADD, NULL, s1, s2);
    /* dead: feeds nothing that an output or the loss reads */
    kt_value d = tu_op1(g, "dead_silu", KT_OP_SILU, NULL, x_unused);
    d = tu_op2(g, "dead_mm", KT_OP_MATMUL, NULL, d, w);
    (void)d;
    logits = tu_op2(g, "head", KT_OP_MATMUL, NULL, s, v);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, NULL, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static void test_compile_options(void **state)
{
    (void)state;
    kt_threadpool *pool;
    OK(kt_threadpool_create(2, &pool));
    kt_graph *g = build_duplicates();
    assert_int_equal(kt_graph_node_count(g), 10);
    kt_program *p, *q, *f;
    OK(kt_compile(g, NULL, &p));
    kt_compile_options no_cse = {.training = 1, .no_cse = 1};
    OK(kt_compile(g, &no_cse, &q));
    kt_program_stats sp, sq;
    kt_program_get_stats(p, &sp);
    kt_program_get_stats(q, &sq);
    /* CSE: mm_b merged into mm_a; DCE: the two dead nodes dropped; 10 - 1 - 2 = 7 */
    assert_int_equal(sp.n_forward_steps, 7);
    assert_int_equal(sq.n_forward_steps, 8); /* only DCE */
    assert_true(sq.n_buffers > sp.n_buffers);
    assert_true(sq.forward_flops > sp.forward_flops);
    assert_true(describe_has(p, "mm_a"));
    assert_false(describe_has(p, "mm_b"));
    assert_true(describe_has(q, "mm_b"));
    assert_true(describe_has(p, "half") && describe_has(p, "third"));
    assert_false(describe_has(p, "dead_"));
    assert_false(describe_has(q, "dead_"));
    /* inputs are never removed, even when only dead nodes read them */
    assert_int_equal(kt_program_count(p, KT_ROLE_INPUT), 3);

    /* forward only */
    kt_compile_options fwd = {.training = 0};
    OK(kt_compile(g, &fwd, &f));
    kt_program_stats sf;
    kt_program_get_stats(f, &sf);
    assert_int_equal(sf.n_forward_steps, 7);
    assert_int_equal(sf.n_backward_steps, 0);
    assert_true(sf.backward_flops == 0.0);
    assert_int_equal(kt_program_count(f, KT_ROLE_GRAD), 0);
    assert_int_equal(sf.grad_bytes, 0);
    assert_true(sf.arena_bytes < sp.arena_bytes);

    /* the three compute the same loss; CSE and no CSE the same gradients */
    kt_session *s[3];
    kt_program *progs[3] = {p, q, f};
    float loss[3];
    for (int k = 0; k < 3; k++) {
        kt_session_options so = {.pool = pool, .seed = 21};
        OK(kt_session_create(progs[k], &so, &s[k]));
        assert_true(fill_inputs(s[k], progs[k], 4));
        OK(kt_session_forward(s[k]));
        loss[k] = kt_session_loss(s[k]);
    }
    assert_true(isfinite(loss[0]) && loss[0] > 0);
    assert_memory_equal(&loss[0], &loss[1], sizeof(float));
    assert_memory_equal(&loss[0], &loss[2], sizeof(float));
    OK(kt_session_backward(s[0]));
    OK(kt_session_backward(s[1]));
    TU_EXPECT_ERROR(kt_session_backward(s[2]), KT_ESTATE, "without training");
    TU_EXPECT_ERROR(kt_session_tensor(s[2], KT_ROLE_GRAD, "w", &(kt_tensor){0}), KT_EINVAL,
                    "'w'");
    const char *names[2] = {"w", "v"};
    for (int k = 0; k < 2; k++) {
        kt_tensor ga, gb;
        OK(kt_session_tensor(s[0], KT_ROLE_GRAD, names[k], &ga));
        OK(kt_session_tensor(s[1], KT_ROLE_GRAD, names[k], &gb));
        double e = tu_rel_err(&ga, &gb, 1e-12);
        if (!(e <= 1e-6))
            fail_msg("gradient of %s: CSE and no_cse differ by %g", names[k], e);
        assert_true(tu_get(&ga, 0) != 0.0);
    }
    for (int k = 0; k < 3; k++)
        kt_session_destroy(s[k]);
    kt_program_destroy(p);
    kt_program_destroy(q);
    kt_program_destroy(f);
    kt_graph_destroy(g);
    kt_threadpool_destroy(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_truncated_and_flipped),
        cmocka_unit_test(test_corrupt_content_valid_checksum),
        cmocka_unit_test(test_hand_edited_programs),
        cmocka_unit_test(test_program_files),
        cmocka_unit_test(test_huge_programs),
        cmocka_unit_test(test_random_field_mutations),
        cmocka_unit_test(test_zero_allocations),
        cmocka_unit_test(test_bad_builds),
        cmocka_unit_test(test_compile_options),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
