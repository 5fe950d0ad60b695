/* kt-train's data side (tools/kt-train/data.c, prepared.c) on kt-data's prepared files: the
 * values each program input gets per step, against a reference written here from the format's
 * rules (and a window worked out by hand), the unigram baseline and bytes per token, flat
 * files as before, and every refusal (the message checked).
 *
 * The programs are tests/data/segments_lm.ktg (tokens, targets, segments) and labels_lm.ktg
 * (kt-import's input_ids and unshifted labels, no segments). */
#include <math.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/test_util.h"
#include "tools/kt-train/train.h"

/* ---- the data: four documents of 5, 7, 3 and 8 tokens ------------------------------------- */

enum { N = 23, B = 2, T = 4, W = B * T, VOCAB = 16 };
static const int doc_sizes[4] = {5, 7, 3, 8};
static int32_t tok[N], doc[N];
static uint8_t mask[N];
static char *dir;

static void make_data(void)
{
    int i = 0;
    for (int d = 0; d < 4; d++)
        for (int k = 0; k < doc_sizes[d]; k++, i++) {
            tok[i] = (3 * i + 1) % VOCAB;
            doc[i] = d;
            /* a text document; a prompt of 3 and its response; all prompt but the EOS; a
             * prompt of 2 */
            mask[i] = d == 0 ? 1 : d == 1 ? k >= 3 : d == 2 ? k == doc_sizes[d] - 1 : k >= 2;
        }
}

static char *path_in(const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* A prepared file written as kt-data writes it (the header by hand, the data section tokens,
 * documents, mask), with the given lengths and metadata; `meta` is the __metadata__ object's
 * members. */
static char *write_prepared(const char *name, const int32_t *t, int64_t nt, const uint8_t *m,
                            int64_t nm, const int32_t *d, int64_t nd, const char *meta)
{
    char header[1024];
    int len = snprintf(header, sizeof header,
                       "{\"__metadata__\":{%s},"
                       "\"tokens\":{\"dtype\":\"I32\",\"shape\":[%lld],\"data_offsets\":[0,%lld]},"
                       "\"doc_index\":{\"dtype\":\"I32\",\"shape\":[%lld],"
                       "\"data_offsets\":[%lld,%lld]},"
                       "\"loss_mask\":{\"dtype\":\"U8\",\"shape\":[%lld],"
                       "\"data_offsets\":[%lld,%lld]}}",
                       meta, (long long)nt, (long long)(4 * nt), (long long)nd,
                       (long long)(4 * nt), (long long)(4 * nt + 4 * nd), (long long)nm,
                       (long long)(4 * nt + 4 * nd), (long long)(4 * nt + 4 * nd + nm));
    while ((8 + len) % 8 != 0)
        header[len++] = ' ';
    char *path = path_in(name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    unsigned char n8[8];
    for (int i = 0; i < 8; i++)
        n8[i] = (unsigned char)((uint64_t)len >> (8 * i));
    assert_int_equal(fwrite(n8, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, (size_t)len, f), (size_t)len);
    assert_int_equal(fwrite(t, 4, (size_t)nt, f), (size_t)nt); /* little-endian hosts */
    assert_int_equal(fwrite(d, 4, (size_t)nd, f), (size_t)nd);
    assert_int_equal(fwrite(m, 1, (size_t)nm, f), (size_t)nm);
    assert_int_equal(fclose(f), 0);
    return path;
}

#define META(vocab) "\"kt.format\":\"kt-tokens-1\",\"kt.bytes\":\"46\",\"kt.vocab\":\"" vocab \
                    "\",\"kt.tokenizer\":\"bytes\""

static char *good_file(void)
{
    return write_prepared("good.safetensors", tok, N, mask, N, doc, N, META("16"));
}

/* ---- the programs and the run ------------------------------------------------------------ */

static kt_program *program(const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/%s", KT_SOURCE_DIR, name);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    kt_program *p = tu_compile_ktg(text, name, 1);
    assert_non_null(p);
    return p;
}

static train_args args(const char *program_name)
{
    return (train_args){.program = program_name, .tokens_input = "tokens",
                        .targets_input = "targets", .labels_input = "labels",
                        .token_bytes = 2};
}

static const ranks one_rank = {.comm = NULL, .rank = 0, .world = 1};

typedef struct run {
    kt_program *p;
    kt_session *s;
    token_data d;
} run;

static void start(run *r, const char *ktg, const char *data, const train_args *a)
{
    r->p = program(ktg);
    assert_int_equal(data_open(&r->d, data, a, r->p, &one_rank), 0);
    kt_session_options so = {.seed = 1};
    OK(kt_session_create(r->p, &so, &r->s));
    assert_int_equal(data_bind(&r->d, r->s), 0);
}

static void stop(run *r)
{
    data_close(&r->d);
    kt_session_destroy(r->s);
    kt_program_destroy(r->p);
}

static const int32_t *input(const run *r, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(r->s, KT_ROLE_INPUT, name, &t));
    assert_int_equal(t.dtype, KT_I32);
    assert_int_equal(kt_tensor_numel(&t), W);
    return t.data;
}

/* ---- the reference: the format's rules over the arrays ------------------------------------ */

/* Whether file position q starts a document (position 0 always does: a window that wraps
 * around the end joins the last document to the first). */
static int starts_doc(int64_t q)
{
    return q == 0 || doc[q] != doc[q - 1];
}

static int32_t ref_target(int64_t start, int g)
{
    int64_t q = (start + g + 1) % N;
    return mask[q] && !starts_doc(q) ? tok[q] : -100;
}

static int32_t ref_label(int64_t start, int g)
{
    int64_t q = (start + g) % N;
    return mask[q] && !starts_doc(q) ? tok[q] : -100;
}

/* The segment of window position g: the document starts in its row before it, counted from
 * the row's first token. */
static int32_t ref_segment(int64_t start, int g)
{
    int32_t s = 0;
    for (int i = g - g % T + 1; i <= g; i++)
        s += starts_doc((start + i) % N);
    return s;
}

/* ---- the tests ------------------------------------------------------------------------------ */

static void feeds_tokens_targets_segments(void **state)
{
    (void)state;
    char *path = good_file();
    train_args a = args("segments_lm.ktg");
    run r;
    start(&r, "segments_lm.ktg", path, &a);
    assert_int_equal(r.d.n_tokens, N);
    assert_int_equal(r.d.n_docs, 4);
    /* step 0 by hand: documents 0 (tokens 0-4) and 1 (5-11, its first 3 a prompt) */
    assert_int_equal(data_load_step(&r.d, 0, &one_rank), 0);
    const int32_t hand_targets[W] = {4, 7, 10, 13, -100, -100, -100, 9};
    const int32_t hand_segments[W] = {0, 0, 0, 0, 0, 1, 1, 1};
    const int32_t *tg = input(&r, "targets"), *sg = input(&r, "segments"),
                  *tk = input(&r, "tokens");
    for (int g = 0; g < W; g++) {
        assert_int_equal(tk[g], tok[g]);
        assert_int_equal(tg[g], hand_targets[g]);
        assert_int_equal(sg[g], hand_segments[g]);
    }
    /* every step of three passes over the file, the wrapping windows among them */
    for (int64_t step = 0; step < 9; step++) {
        assert_int_equal(data_load_step(&r.d, step, &one_rank), 0);
        const int64_t s0 = step * W % N;
        for (int g = 0; g < W; g++) {
            assert_int_equal(tk[g], tok[(s0 + g) % N]);
            assert_int_equal(tg[g], ref_target(s0, g));
            assert_int_equal(sg[g], ref_segment(s0, g));
        }
    }
    /* the window from 16 wraps: 16-22 is document 3, then document 0 starts again */
    assert_int_equal(data_load_step(&r.d, 2, &one_rank), 0);
    assert_int_equal(sg[4], 0);
    assert_int_equal(sg[7], 1);
    assert_int_equal(tg[6], -100);
    assert_int_equal(data_bytes_per_token(&r.d), 2.0);
    stop(&r);
    free(path);
}

/* kt-import's programs: labels unshifted, so that their shift_labels gives the targets above
 * (the last of each row aside, which shift_labels ignores) */
static void feeds_labels(void **state)
{
    (void)state;
    char *path = good_file();
    train_args a = args("labels_lm.ktg");
    a.allow_cross_document = 1;
    run r;
    start(&r, "labels_lm.ktg", path, &a);
    for (int64_t step = 0; step < 6; step++) {
        assert_int_equal(data_load_step(&r.d, step, &one_rank), 0);
        const int64_t s0 = step * W % N;
        const int32_t *ids = input(&r, "input_ids"), *lb = input(&r, "labels");
        for (int g = 0; g < W; g++) {
            assert_int_equal(ids[g], tok[(s0 + g) % N]);
            assert_int_equal(lb[g], ref_label(s0, g));
            if (g % T != T - 1)
                assert_int_equal(lb[g + 1], ref_target(s0, g));
        }
    }
    assert_int_equal(data_load_step(&r.d, 0, &one_rank), 0);
    const int32_t hand[W] = {-100, 4, 7, 10, 13, -100, -100, -100};
    for (int g = 0; g < W; g++)
        assert_int_equal(input(&r, "labels")[g], hand[g]);
    stop(&r);
    free(path);
}

/* a flat file: one document, every target counts, segments 0 */
static void flat_file(void **state)
{
    (void)state;
    char *path = path_in("flat.bin");
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    for (int i = 0; i < N; i++) {
        unsigned char b[2] = {(unsigned char)tok[i], 0};
        assert_int_equal(fwrite(b, 1, 2, f), 2);
    }
    fclose(f);
    train_args a = args("segments_lm.ktg");
    run r;
    start(&r, "segments_lm.ktg", path, &a);
    assert_int_equal(r.d.prepared, 0);
    for (int64_t step = 0; step < 4; step++) {
        assert_int_equal(data_load_step(&r.d, step, &one_rank), 0);
        const int64_t s0 = step * W % N;
        for (int g = 0; g < W; g++) {
            assert_int_equal(input(&r, "targets")[g], tok[(s0 + g + 1) % N]);
            assert_int_equal(input(&r, "segments")[g], 0);
        }
    }
    assert_int_equal(data_bytes_per_token(&r.d), 0.0); /* u16: unknown */
    stop(&r);
    free(path);
}

/* Context parallelism with cp_attention's balanced layout: over 3 ranks each row of 6
 * positions is cut into 6 chunks of 1, rank r holds chunks r and 5-r, and every sharded input
 * (tokens, targets, segments, positions) gets the window's values there; positions are the
 * global ones. A rank's part of odd length is refused. */
static const char cp_src[] =
    "const B = 2\n"
    "const T = 2\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input segments: i32[B, T]\n"
    "input positions: i32[B, T]\n"
    "shard tokens dim 1\n"
    "shard targets dim 1\n"
    "shard segments dim 1\n"
    "shard positions dim 1\n"
    "param embed: f32[16, 4] = normal(0.5)\n"
    "param head: f32[16, 4] = normal(0.5)\n"
    "e = embedding(embed, tokens)\n"
    "q = reshape(e, shape = [B, T, 1, 4])\n"
    "q = rope(q, positions)\n"
    "o, lse = cp_attention(q, q, q, segments)\n"
    "h = reshape(o, shape = [B * T, 4])\n"
    "logits = matmul(h, head, trans_b = 1)\n"
    "t = reshape(targets, shape = [B * T])\n"
    "loss = cross_entropy(logits, t)\n"
    "loss loss\n";

static void balanced_shards(void **state)
{
    (void)state;
    enum { WORLD = 3, LT = 2, ROW = WORLD * LT };
    char *path = good_file();
    kt_program *p = tu_compile_ktg(cp_src, "cp.ktg", 1);
    assert_non_null(p);
    train_args a = args("cp.ktg");
    for (int rank = 0; rank < WORLD; rank++) {
        const ranks r = {.comm = NULL, .rank = rank, .world = WORLD};
        token_data d;
        assert_int_equal(data_open(&d, path, &a, p, &r), 0);
        assert_int_equal(d.window, B * ROW);
        kt_session *s;
        kt_session_options so = {.seed = 1};
        OK(kt_session_create(p, &so, &s));
        assert_int_equal(data_bind(&d, s), 0);
        for (int64_t step = 0; step < 2; step++) {
            assert_int_equal(data_load_step(&d, step, &r), 0);
            const int64_t start = step * B * ROW % N;
            kt_tensor tk, tg, sg, ps;
            OK(kt_session_tensor(s, KT_ROLE_INPUT, "tokens", &tk));
            OK(kt_session_tensor(s, KT_ROLE_INPUT, "targets", &tg));
            OK(kt_session_tensor(s, KT_ROLE_INPUT, "segments", &sg));
            OK(kt_session_tensor(s, KT_ROLE_INPUT, "positions", &ps));
            for (int b = 0; b < B; b++)
                for (int i = 0; i < LT; i++) {
                    const int pos = i < LT / 2 ? rank : 2 * WORLD - 1 - rank; /* chunks of 1 */
                    const int g = b * ROW + pos, at = b * LT + i;
                    int32_t seg = 0;
                    for (int j = b * ROW + 1; j <= g; j++)
                        seg += starts_doc((start + j) % N);
                    assert_int_equal(((int32_t *)tk.data)[at], tok[(start + g) % N]);
                    assert_int_equal(((int32_t *)tg.data)[at], ref_target(start, g));
                    assert_int_equal(((int32_t *)sg.data)[at], seg);
                    assert_int_equal(((int32_t *)ps.data)[at], pos);
                }
        }
        kt_session_destroy(s);
        data_close(&d);
    }
    kt_program_destroy(p);
    /* the balanced layout cuts every sharded dimension into two chunks a rank: a batch of
     * 3 rows sharded is refused */
    static const char odd[] = "input tokens: i32[3, 2]\n"
                              "input targets: i32[3, 2]\n"
                              "shard tokens dim 0\n"
                              "shard targets dim 0\n"
                              "param embed: f32[16, 4] = normal(0.5)\n"
                              "param head: f32[16, 4] = normal(0.5)\n"
                              "e = embedding(embed, tokens)\n"
                              "q = reshape(e, shape = [3, 2, 1, 4])\n"
                              "o, lse = cp_attention(q, q, q)\n"
                              "h = reshape(o, shape = [6, 4])\n"
                              "logits = matmul(h, head, trans_b = 1)\n"
                              "t = reshape(targets, shape = [6])\n"
                              "loss = cross_entropy(logits, t)\n"
                              "loss loss\n";
    p = tu_compile_ktg(odd, "cp_odd.ktg", 1);
    assert_non_null(p);
    a.allow_cross_document = 1;
    const ranks r = {.comm = NULL, .rank = 0, .world = 2};
    token_data d;
    assert_int_equal(data_open(&d, path, &a, p, &r), 1);
    assert_non_null(strstr(kt_last_error(), "balanced layout"));
    assert_non_null(strstr(kt_last_error(), "an odd number"));
    data_close(&d);
    kt_program_destroy(p);
    /* one sequence, one layout: two cp_attention ops that disagree are refused, naming both */
    char two[sizeof cp_src + 128];
    snprintf(two, sizeof two, "%s",
             "input tokens: i32[1, 2]\n"
             "shard tokens dim 1\n"
             "param embed: f32[16, 4] = normal(0.5)\n"
             "e = embedding(embed, tokens)\n"
             "q = reshape(e, shape = [1, 2, 1, 4])\n"
             "first, l1 = cp_attention(q, q, q)\n"
             "second, l2 = cp_attention(first, q, q, layout = contiguous)\n"
             "output second\n");
    p = tu_compile_ktg(two, "cp_two.ktg", 0);
    assert_non_null(p);
    assert_int_equal(data_open(&d, path, &a, p, &r), 1);
    assert_non_null(strstr(kt_last_error(), "'second' has layout contiguous but 'first'"));
    data_close(&d);
    kt_program_destroy(p);
    free(path);
}

/* The baseline counts the training file's counted targets and scores the held-out windows'
 * counted targets. */
static void unigram_counts_only_targets(void **state)
{
    (void)state;
    char *train = good_file();
    /* held out: 17 tokens (two windows), every other one masked, two documents */
    int32_t ht[17], hd[17];
    uint8_t hm[17];
    for (int i = 0; i < 17; i++) {
        ht[i] = (5 * i + 2) % VOCAB;
        hd[i] = i >= 6;
        hm[i] = i % 2 == 0;
    }
    char *held = write_prepared("held.safetensors", ht, 17, hm, 17, hd, 17, META("16"));
    train_args a = args("segments_lm.ktg");
    run r, h;
    start(&r, "segments_lm.ktg", train, &a);
    start(&h, "segments_lm.ktg", held, &a);
    double nats = 0;
    assert_int_equal(data_unigram_loss(&r.d, &h.d, &nats), 0);
    double counts[VOCAB] = {0}, counted = 0;
    for (int i = 0; i < N; i++)
        if (mask[i] && !starts_doc(i)) {
            counts[tok[i]]++;
            counted++;
        }
    double sum = 0;
    int predicted = 0;
    for (int i = 1; i <= 16; i++) /* windows 0 and 1: targets at 1..8 and 9..16 */
        if (hm[i] && hd[i] == hd[i - 1]) {
            sum -= log((counts[ht[i]] + 1) / (counted + VOCAB));
            predicted++;
        }
    assert_true(predicted > 0 && predicted < 16);
    assert_true(fabs(nats - sum / predicted) < 1e-12);
    stop(&r);
    stop(&h);
    free(train);
    free(held);
}

/* data_open refuses the file with a message naming what is wrong */
static void refused(const char *ktg, const char *path, int allow, const char *a1,
                    const char *a2)
{
    kt_program *p = program(ktg);
    train_args a = args(ktg);
    a.allow_cross_document = allow;
    token_data d;
    assert_int_equal(data_open(&d, path, &a, p, &one_rank), 1);
    const char *msg = kt_last_error();
    if (strstr(msg, a1) == NULL || (a2 && strstr(msg, a2) == NULL))
        fail_msg("expected '%s' and '%s' in: %s", a1, a2 ? a2 : "", msg);
    data_close(&d);
    kt_program_destroy(p);
}

static void refusals(void **state)
{
    (void)state;
    char *p;
    p = write_prepared("vocab.safetensors", tok, N, mask, N, doc, N, META("151936"));
    refused("segments_lm.ktg", p, 0, "vocabulary of 151936", "program's 16");
    free(p);
    p = write_prepared("mask.safetensors", tok, N, mask, N - 1, doc, N, META("16"));
    refused("segments_lm.ktg", p, 0, "a mask of the wrong length", "loss_mask holds 22 "
            "values, tokens 23");
    free(p);
    p = write_prepared("docs.safetensors", tok, N, mask, N, doc, N - 2, META("16"));
    refused("segments_lm.ktg", p, 0, "a mask of the wrong length", "doc_index holds 21");
    free(p);
    int32_t bad[N];
    memcpy(bad, tok, sizeof bad);
    bad[17] = 16;
    p = write_prepared("id.safetensors", bad, N, mask, N, doc, N, META("16"));
    refused("segments_lm.ktg", p, 0, "token 17 ", "is 16, outside the model's vocabulary "
            "[0, 16)");
    free(p);
    int32_t back[N];
    memcpy(back, doc, sizeof back);
    back[20] = 1;
    p = write_prepared("back.safetensors", tok, N, mask, N, back, N, META("16"));
    refused("segments_lm.ktg", p, 0, "doc_index[20] is 1 after 3", "never decrease");
    free(p);
    uint8_t two[N];
    memcpy(two, mask, sizeof two);
    two[3] = 2;
    p = write_prepared("two.safetensors", tok, N, two, N, doc, N, META("16"));
    refused("segments_lm.ktg", p, 0, "loss_mask[3] is 2", "0 or 1");
    free(p);
    p = write_prepared("noformat.safetensors", tok, N, mask, N, doc, N, "\"kt.vocab\":\"16\"");
    refused("segments_lm.ktg", p, 0, "without kt.format", "kt-data");
    free(p);
    p = write_prepared("format.safetensors", tok, N, mask, N, doc, N,
                       "\"kt.format\":\"kt-tokens-9\",\"kt.vocab\":\"16\"");
    refused("segments_lm.ktg", p, 0, "kt.format is 'kt-tokens-9'", "kt-tokens-1");
    free(p);
    p = write_prepared("novocab.safetensors", tok, N, mask, N, doc, N,
                       "\"kt.format\":\"kt-tokens-1\"");
    refused("segments_lm.ktg", p, 0, "without kt.vocab", NULL);
    free(p);
    p = write_prepared("short.safetensors", tok, 8, mask, 8, doc, 8, META("16"));
    refused("segments_lm.ktg", p, 0, "holds 8 tokens; one step needs 9", NULL);
    free(p);
    /* several documents, and a program whose attention cannot keep them apart */
    p = good_file();
    refused("labels_lm.ktg", p, 0, "4 documents packed together", "--allow-cross-document");
    /* a flat-file option with a prepared file */
    kt_program *prog = program("segments_lm.ktg");
    train_args a = args("segments_lm.ktg");
    a.data_header = 1024;
    token_data d;
    assert_int_equal(data_open(&d, p, &a, prog, &one_rank), 1);
    assert_non_null(strstr(kt_last_error(), "--data-header is for flat token files"));
    data_close(&d);
    kt_program_destroy(prog);
    free(p);
}

int main(void)
{
    make_data();
    dir = tu_temp_dir("kt_data_feed");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(feeds_tokens_targets_segments),
        cmocka_unit_test(feeds_labels),
        cmocka_unit_test(flat_file),
        cmocka_unit_test(balanced_shards),
        cmocka_unit_test(unigram_counts_only_targets),
        cmocka_unit_test(refusals),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tu_remove_tree(dir);
    free(dir);
    return rc;
}
