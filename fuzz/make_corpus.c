/* Writes the fuzzers' seed corpus: a few valid .ktp programs (training and forward-only, using
 * most ops) into DIR/ktp, a few valid safetensors files into DIR/safetensors, MoE experts
 * files (a quantized and a bf16 layer's) into DIR/moe and kt-data's
 * prepared token files into DIR/prepared. Run at build
 * time, so no binary file is committed.
 *
 *   kt_fuzz_make_corpus DIR        (DIR/ktp and DIR/safetensors must be creatable) */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kt/io.h"
#include "kt/program.h"

#define CHECK(expr)                                                                           \
    do {                                                                                      \
        if ((expr) != KT_OK) {                                                                \
            fprintf(stderr, "kt_fuzz_make_corpus: %s: %s\n", #expr, kt_last_error());         \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

static kt_value op(kt_graph *g, const char *name, kt_op o, const kt_op_attrs *attrs,
                   const kt_value *in, int n_in)
{
    kt_value out[KT_OP_MAX_OUT];
    CHECK(kt_graph_op(g, name, o, attrs, in, n_in, out));
    return out[0];
}
#define OP(g, name, o, attrs, ...)                                                             \
    op((g), (name), (o), (attrs), (const kt_value[]){__VA_ARGS__},                             \
       (int)(sizeof((const kt_value[]){__VA_ARGS__}) / sizeof(kt_value)))

static void save_program(kt_graph *g, int training, const char *dir, const char *name)
{
    kt_compile_options co = {.training = training};
    kt_program *p;
    CHECK(kt_compile(g, &co, &p));
    char path[4096];
    snprintf(path, sizeof path, "%s/ktp/%s.ktp", dir, name);
    CHECK(kt_program_save(p, path));
    kt_program_destroy(p);
}

/* MLP: matmul, add, silu, cross_entropy; a frozen bias. */
static void mlp(const char *dir)
{
    kt_graph *g;
    kt_value x, y, w1, b1, w2, b2, h, logits;
    CHECK(kt_graph_create(&g));
    CHECK(kt_graph_input(g, "x", KT_F32, 2, SHAPE(4, 3), &x));
    CHECK(kt_graph_input(g, "y", KT_I32, 1, SHAPE(4), &y));
    CHECK(kt_graph_param(g, "w1", KT_F32, 2, SHAPE(3, 5), kt_init_normal(0.3f), &w1));
    CHECK(kt_graph_param(g, "b1", KT_F32, 1, SHAPE(5), kt_init_zeros(), &b1));
    CHECK(kt_graph_param(g, "w2", KT_F32, 2, SHAPE(5, 2), kt_init_uniform(-0.5f, 0.5f), &w2));
    CHECK(kt_graph_const_param(g, "b2", KT_F32, 1, SHAPE(2), kt_init_zeros(), &b2));
    h = OP(g, "fc1", KT_OP_MATMUL, NULL, x, w1);
    h = OP(g, "bias1", KT_OP_ADD, NULL, h, b1);
    h = OP(g, "act", KT_OP_SILU, NULL, h);
    logits = OP(g, "fc2", KT_OP_MATMUL, NULL, h, w2);
    logits = OP(g, "bias2", KT_OP_ADD, NULL, logits, b2);
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ce.ignore_index = -100;
    CHECK(kt_graph_set_loss(g, OP(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y)));
    CHECK(kt_graph_output(g, logits, "logits"));
    save_program(g, 1, dir, "mlp_train");
    save_program(g, 0, dir, "mlp_forward");
    kt_graph_destroy(g);
}

/* conv1d (causal, depthwise same), rmsnorm, embedding, log_softmax, i64 targets. */
static void conv_lm(const char *dir)
{
    kt_graph *g;
    kt_value ids, tgt, emb, wc, wd, gain, wo, e, c, n, logits;
    CHECK(kt_graph_create(&g));
    CHECK(kt_graph_input(g, "ids", KT_I32, 1, SHAPE(6), &ids));
    CHECK(kt_graph_input(g, "targets", KT_I64, 1, SHAPE(6), &tgt));
    CHECK(kt_graph_param(g, "embed", KT_F32, 2, SHAPE(7, 4), kt_init_normal(0.5f), &emb));
    CHECK(kt_graph_param(g, "conv", KT_F32, 3, SHAPE(4, 3, 4), kt_init_normal(0.2f), &wc));
    CHECK(kt_graph_param(g, "dw", KT_F32, 2, SHAPE(4, 3), kt_init_normal(0.3f), &wd));
    CHECK(kt_graph_param(g, "gain", KT_F32, 1, SHAPE(4), kt_init_uniform(0.8f, 1.2f), &gain));
    CHECK(kt_graph_param(g, "unembed", KT_F32, 2, SHAPE(4, 7), kt_init_normal(0.3f), &wo));
    e = OP(g, "embed", KT_OP_EMBEDDING, NULL, emb, ids);
    kt_op_attrs causal = kt_op_defaults(KT_OP_CONV1D);
    causal.conv_mode = KT_CONV_CAUSAL;
    kt_op_attrs dw_same = kt_op_defaults(KT_OP_CONV1D);
    dw_same.conv_mode = KT_CONV_SAME;
    dw_same.depthwise = 1;
    c = OP(g, "conv", KT_OP_CONV1D, &causal, e, wc);
    c = OP(g, "dwconv", KT_OP_CONV1D, &dw_same, c, wd);
    c = OP(g, "residual", KT_OP_ADD, NULL, c, e);
    kt_op_attrs norm = kt_op_defaults(KT_OP_RMSNORM);
    norm.eps = 1e-5f;
    n = OP(g, "norm", KT_OP_RMSNORM, &norm, c, gain);
    logits = OP(g, "unembed", KT_OP_MATMUL, NULL, n, wo);
    CHECK(kt_graph_output(g, OP(g, "logprobs", KT_OP_LOG_SOFTMAX, NULL, logits), "logprobs"));
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ce.ignore_index = -1;
    CHECK(kt_graph_set_loss(g, OP(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, tgt)));
    save_program(g, 1, dir, "conv_lm_train");
    kt_graph_destroy(g);
}

/* swiglu, topk_router (two outputs), transpose, reshape, narrow, concat, scale, sub, mul,
 * softmax; with a loss (training) and without. */
static void shapes(const char *dir, int with_loss)
{
    kt_graph *g;
    kt_value x, y, wg, wu, wr, s, r, t, a, b, c, f, route[2];
    CHECK(kt_graph_create(&g));
    CHECK(kt_graph_input(g, "x", KT_F32, 2, SHAPE(4, 6), &x));
    CHECK(kt_graph_input(g, "y", KT_I32, 1, SHAPE(4), &y));
    CHECK(kt_graph_param(g, "wg", KT_F32, 2, SHAPE(6, 8), kt_init_normal(0.3f), &wg));
    CHECK(kt_graph_param(g, "wu", KT_F32, 2, SHAPE(6, 8), kt_init_normal(0.3f), &wu));
    CHECK(kt_graph_param(g, "wr", KT_F32, 2, SHAPE(8, 3), kt_init_normal(0.3f), &wr));
    s = OP(g, "swiglu", KT_OP_SWIGLU, NULL, OP(g, "gate", KT_OP_MATMUL, NULL, x, wg),
           OP(g, "up", KT_OP_MATMUL, NULL, x, wu));
    r = OP(g, "router_logits", KT_OP_MATMUL, NULL, s, wr);
    kt_op_attrs topk = kt_op_defaults(KT_OP_TOPK_ROUTER);
    topk.k = 2;
    topk.norm_topk = 1;
    CHECK(kt_graph_op(g, "router", KT_OP_TOPK_ROUTER, &topk, &r, 1, route));
    kt_op_attrs tr = kt_op_defaults(KT_OP_TRANSPOSE);
    tr.dim0 = 0;
    tr.dim1 = 1;
    t = OP(g, "transpose", KT_OP_TRANSPOSE, &tr, s);
    kt_op_attrs rs = kt_op_defaults(KT_OP_RESHAPE);
    rs.ndim = 2;
    rs.shape[0] = 4;
    rs.shape[1] = 8;
    t = OP(g, "reshape", KT_OP_RESHAPE, &rs, t);
    kt_op_attrs na = kt_op_defaults(KT_OP_NARROW), nb = na;
    na.dim = nb.dim = 1;
    na.start = 0, na.length = 3;
    nb.start = 3, nb.length = 5;
    a = OP(g, "left", KT_OP_NARROW, &na, t);
    b = OP(g, "right", KT_OP_NARROW, &nb, t);
    kt_op_attrs cat = kt_op_defaults(KT_OP_CONCAT);
    cat.dim = 1;
    c = OP(g, "concat", KT_OP_CONCAT, &cat, b, a);
    kt_op_attrs half = kt_op_defaults(KT_OP_SCALE);
    half.alpha = 0.5f;
    c = OP(g, "scale", KT_OP_SCALE, &half, c);
    f = OP(g, "mul", KT_OP_MUL, NULL, OP(g, "sub", KT_OP_SUB, NULL, c, s), s);
    CHECK(kt_graph_output(g, OP(g, "softmax", KT_OP_SOFTMAX, NULL, f), "probs"));
    CHECK(kt_graph_output(g, route[0], "expert_ids"));
    CHECK(kt_graph_output(g, route[1], "expert_weights"));
    if (with_loss) {
        kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
        ce.ignore_index = -100;
        CHECK(kt_graph_set_loss(g, OP(g, "loss", KT_OP_CROSS_ENTROPY, &ce, f, y)));
    }
    save_program(g, with_loss, dir, with_loss ? "ops_train" : "ops_forward");
    kt_graph_destroy(g);
}

static void *filled(kt_tensor *t, kt_dtype dtype, int ndim, const int64_t *shape)
{
    CHECK(kt_tensor_init(t, NULL, dtype, ndim, shape));
    size_t bytes = kt_tensor_nbytes(t);
    unsigned char *p = malloc(bytes ? bytes : 1);
    if (p == NULL)
        exit(1);
    for (size_t i = 0; i < bytes; i++)
        p[i] = (unsigned char)(i * 37 + 11);
    t->data = p;
    return p;
}

static void save_st(const char *dir, const char *name, kt_st_item *items, size_t n,
                    const char *const *metadata)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/safetensors/%s.safetensors", dir, name);
    CHECK(kt_st_save(path, items, n, metadata));
    for (size_t i = 0; i < n; i++)
        free(items[i].tensor.data);
}

static void safetensors(const char *dir)
{
    kt_st_item all[6] = {{"f32", {0}}, {"bf16", {0}}, {"f16 \"quoted\" \xc3\xa9", {0}},
                         {"i32.scalar", {0}}, {"i64", {0}}, {"empty", {0}}};
    filled(&all[0].tensor, KT_F32, 3, SHAPE(2, 3, 4));
    filled(&all[1].tensor, KT_BF16, 1, SHAPE(7));
    filled(&all[2].tensor, KT_F16, 2, SHAPE(3, 5));
    filled(&all[3].tensor, KT_I32, 0, NULL);
    filled(&all[4].tensor, KT_I64, 4, SHAPE(2, 1, 2, 2));
    filled(&all[5].tensor, KT_F32, 2, SHAPE(0, 3));
    static const char *const meta[] = {"format", "pt", "kt.step", "12", NULL};
    save_st(dir, "dtypes", all, 6, meta);

    kt_st_item one[1] = {{"weight", {0}}};
    filled(&one[0].tensor, KT_F32, 2, SHAPE(4, 4));
    save_st(dir, "single", one, 1, NULL);

    save_st(dir, "empty_file", NULL, 0, NULL);
    static const char *const only_meta[] = {"note", "no tensors", NULL};
    save_st(dir, "metadata_only", NULL, 0, only_meta);

    /* hand-written: unpadded header, fields in another order, escapes in a name */
    static const char header[] =
        "{\"a\\u00e9\\n\":{\"shape\":[2],\"data_offsets\":[0,8],\"dtype\":\"I32\"},"
        "\"b\":{\"data_offsets\":[8,10],\"dtype\":\"BF16\",\"shape\":[]}}";
    unsigned char file[8 + sizeof header - 1 + 10];
    uint64_t len = sizeof header - 1;
    for (int i = 0; i < 8; i++)
        file[i] = (unsigned char)(len >> (8 * i));
    memcpy(file + 8, header, len);
    for (int i = 0; i < 10; i++)
        file[8 + len + (uint64_t)i] = (unsigned char)(i + 1);
    char path[4096];
    snprintf(path, sizeof path, "%s/safetensors/handwritten.safetensors", dir);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(file, 1, sizeof file, f) != sizeof file || fclose(f) != 0) {
        fprintf(stderr, "kt_fuzz_make_corpus: cannot write %s\n", path);
        exit(1);
    }
    /* it must be valid: a seed the reader rejects would be wasted */
    kt_st_file *st;
    CHECK(kt_st_open(path, &st));
    kt_st_close(st);
}

/* kt-data's prepared token files (kt-tokens-1): written by hand, as the library has no U8
 * tensors to write the loss mask with. n tokens of two documents. */
static void prepared(const char *dir, const char *name, int n)
{
    char header[512];
    int len = snprintf(header, sizeof header,
                       "{\"__metadata__\":{\"kt.format\":\"kt-tokens-1\",\"kt.vocab\":\"257\","
                       "\"kt.bytes\":\"%d\",\"kt.tokenizer\":\"bytes\"},"
                       "\"tokens\":{\"dtype\":\"I32\",\"shape\":[%d],\"data_offsets\":[0,%d]},"
                       "\"loss_mask\":{\"dtype\":\"U8\",\"shape\":[%d],\"data_offsets\":[%d,%d]},"
                       "\"doc_index\":{\"dtype\":\"I32\",\"shape\":[%d],"
                       "\"data_offsets\":[%d,%d]}}",
                       n, n, 4 * n, n, 4 * n, 5 * n, n, 5 * n, 9 * n);
    char path[4096];
    snprintf(path, sizeof path, "%s/prepared/%s.safetensors", dir, name);
    FILE *f = fopen(path, "wb");
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)len >> (8 * i));
    int ok = f != NULL && fwrite(b, 1, 8, f) == 8 && fwrite(header, 1, (size_t)len, f) == (size_t)len;
    for (int i = 0; ok && i < n; i++) { /* tokens: bytes of "hello world..." */
        uint32_t t = (uint32_t)"hello world, prepared"[i % 21];
        unsigned char le[4] = {(unsigned char)t, 0, 0, 0};
        ok = fwrite(le, 1, 4, f) == 4;
    }
    for (int i = 0; ok && i < n; i++) /* the mask: the first document's first token off */
        ok = fputc(i == 0 ? 0 : 1, f) != EOF;
    for (int i = 0; ok && i < n; i++) {
        unsigned char le[4] = {(unsigned char)(i < n / 2 ? 0 : 1), 0, 0, 0};
        ok = fwrite(le, 1, 4, f) == 4;
    }
    if (f == NULL || !ok || fclose(f) != 0) {
        fprintf(stderr, "kt_fuzz_make_corpus: cannot write %s\n", path);
        exit(1);
    }
    kt_st_file *st;
    CHECK(kt_st_open(path, &st));
    kt_st_close(st);
}

/* The experts of fuzz_moe_load's layers (H = I = 64, E = 2, LoRA r 2): a quantized layer's
 * save (codes, scales, adapters) and a bf16 one's (weights, adapters). */
static void moe_seeds(const char *dir)
{
    for (int quant = 0; quant < 2; quant++) {
        const kt_moe_config c = {.n_experts = 2, .hidden = 64, .intermediate = 64, .top_k = 2,
                                 .max_tokens = 2, .weight_dtype = KT_BF16, .act_dtype = KT_F32,
                                 .mode = KT_MOE_LORA, .lora_rank = 2, .lora_alpha = 4.0f,
                                 .numa_node = -1,
                                 .quant = quant ? KT_MOE_QUANT_INT4 : KT_MOE_QUANT_NONE,
                                 .quant_group = 32};
        kt_moe *m = NULL;
        CHECK(kt_moe_create(&c, NULL, &m));
        uint16_t w[64 * 64];
        for (int64_t e = 0; e < 2; e++)
            for (int p = 0; p < 3; p++) {
                for (int i = 0; i < 64 * 64; i++)
                    w[i] = kt_f32_to_bf16_1(0.01f * (float)((i * 7 + (int)e * 3 + p) % 19 - 9));
                const int64_t shape[2] = {64, 64};
                kt_tensor t;
                kt_tensor_init(&t, w, KT_BF16, 2, shape);
                CHECK(kt_moe_set_weight(m, e, (kt_moe_proj)p, &t));
            }
        char path[4096];
        snprintf(path, sizeof path, "%s/moe/%s.safetensors", dir, quant ? "int4" : "bf16");
        CHECK(kt_moe_save(m, path, NULL));
        kt_moe_destroy(m);
    }
}

static void make_dir(const char *dir, const char *sub)
{
    char path[4096];
    snprintf(path, sizeof path, "%s%s%s", dir, sub[0] ? "/" : "", sub);
    if (mkdir(path, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "kt_fuzz_make_corpus: cannot create %s: %s\n", path, strerror(errno));
        exit(1);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: kt_fuzz_make_corpus DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    make_dir(dir, "");
    make_dir(dir, "ktp");
    make_dir(dir, "safetensors");
    make_dir(dir, "prepared");
    make_dir(dir, "moe");
    mlp(dir);
    conv_lm(dir);
    shapes(dir, 0);
    shapes(dir, 1);
    safetensors(dir);
    prepared(dir, "two_documents", 12);
    prepared(dir, "empty", 0);
    moe_seeds(dir);
    /* every seed program must load again */
    static const char *const programs[] = {"mlp_train", "mlp_forward", "conv_lm_train",
                                           "ops_forward", "ops_train"};
    for (size_t i = 0; i < sizeof programs / sizeof programs[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/ktp/%s.ktp", dir, programs[i]);
        kt_program *p;
        CHECK(kt_program_load(path, &p));
        kt_program_destroy(p);
    }
    return 0;
}
