/* The MoE layers' tensors under checkpoint names (issue 30): kt_moe_tensor_name for each
 * scheme, save -> load round trips of every scheme (LoRA adapters too) through kt_moe_save /
 * kt_moe_load and through a session's file, bindings with holes (DeepSeek's dense first
 * layers), the moe op's `intermediate` against the caller's, kt_moe_layers_create /
 * kt_moe_layers_load, and the errors for a missing, misshapen or extra expert tensor, each
 * naming the file and the tensor. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

enum { T = 8, H = 16, I = 12, E = 4, K = 2, V = 5 };

static void temp_path(char *path, size_t size)
{
    snprintf(path, size, "/tmp/kt_test_moe_names_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
}

/* ---- kt_moe_tensor_name ------------------------------------------------------------------- */

static void test_tensor_name(void **state)
{
    (void)state;
    char buf[256];
    OK(kt_moe_tensor_name(KT_MOE_NAMES_MOE, 3, 5, KT_MOE_UP, "weight", buf, sizeof buf));
    assert_string_equal(buf, "moe.3.experts.5.up_proj.weight");
    OK(kt_moe_tensor_name(KT_MOE_NAMES_HF, 0, 3, KT_MOE_UP, "weight", buf, sizeof buf));
    assert_string_equal(buf, "model.layers.0.mlp.experts.3.up_proj.weight");
    OK(kt_moe_tensor_name(KT_MOE_NAMES_HF, 12, 0, KT_MOE_GATE, "lora_A.weight", buf, sizeof buf));
    assert_string_equal(buf, "model.layers.12.mlp.experts.0.gate_proj.lora_A.weight");
    OK(kt_moe_tensor_name(KT_MOE_NAMES_HF, 1, 7, KT_MOE_DOWN, "lora_B.weight", buf, sizeof buf));
    assert_string_equal(buf, "model.layers.1.mlp.experts.7.down_proj.lora_B.weight");
    /* Mixtral: w1 = gate, w3 = up, w2 = down */
    static const char *const mixtral[3] = {"w1", "w3", "w2"};
    for (int p = 0; p < 3; p++) {
        char want[128];
        snprintf(want, sizeof want, "model.layers.2.block_sparse_moe.experts.6.%s.weight",
                 mixtral[p]);
        OK(kt_moe_tensor_name(KT_MOE_NAMES_MIXTRAL, 2, 6, (kt_moe_proj)p, "weight", buf,
                              sizeof buf));
        assert_string_equal(buf, want);
    }
    OK(kt_moe_tensor_name(KT_MOE_NAMES_MIXTRAL, 2, 6, KT_MOE_DOWN, "lora_A.weight", buf,
                          sizeof buf));
    assert_string_equal(buf, "model.layers.2.block_sparse_moe.experts.6.w2.lora_A.weight");
    /* exactly fits, one byte short, bad arguments */
    const size_t len = strlen("moe.3.experts.5.up_proj.weight");
    OK(kt_moe_tensor_name(KT_MOE_NAMES_MOE, 3, 5, KT_MOE_UP, "weight", buf, len + 1));
    strcpy(buf, "untouched");
    TU_EXPECT_ERROR(kt_moe_tensor_name(KT_MOE_NAMES_MOE, 3, 5, KT_MOE_UP, "weight", buf, len),
                    KT_ERANGE, "moe.3.experts.5.up_proj.weight", "needs 31 bytes");
    assert_string_equal(buf, "untouched");
    TU_EXPECT_ERROR(kt_moe_tensor_name(KT_MOE_NAMES_HF, 0, 0, KT_MOE_UP, "bias", buf, sizeof buf),
                    KT_EINVAL, "suffix 'bias'");
    TU_EXPECT_ERROR(kt_moe_tensor_name((kt_moe_names)3, 0, 0, KT_MOE_UP, "weight", buf,
                                       sizeof buf),
                    KT_EINVAL, "unknown MoE tensor names 3");
    TU_EXPECT_ERROR(kt_moe_tensor_name(KT_MOE_NAMES_HF, 0, 0, (kt_moe_proj)3, "weight", buf,
                                       sizeof buf),
                    KT_EINVAL, "unknown projection 3");
    TU_EXPECT_ERROR(kt_moe_tensor_name(KT_MOE_NAMES_HF, -1, 0, KT_MOE_UP, "weight", buf,
                                       sizeof buf),
                    KT_EINVAL, "negative");
}

/* ---- layers ------------------------------------------------------------------------------ */

static kt_moe_config layer_cfg(kt_moe_mode mode, kt_dtype wd, kt_moe_names names, int layer)
{
    return (kt_moe_config){.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                           .max_tokens = T, .weight_dtype = wd, .act_dtype = KT_F32,
                           .mode = mode, .lora_rank = mode == KT_MOE_LORA ? 4 : 0,
                           .lora_alpha = 8.0f, .keep_activations = 1, .name = "named",
                           .numa_node = -1, .names = names, .layer = layer};
}

/* Every weight (and adapter) of the layer from the seed. */
static void fill_layer(kt_moe *m, uint64_t seed)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w;
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &w));
            tu_fill_uniform(&w, &rng, -0.5, 0.5);
            for (int b = 0; c->mode == KT_MOE_LORA && b < 2; b++) {
                OK(kt_moe_lora(m, e, (kt_moe_proj)p, b, &w));
                tu_fill_uniform(&w, &rng, -0.5, 0.5);
            }
        }
}

/* Whether two layers hold the same bytes in every weight and adapter. */
static int same_layer(kt_moe *a, kt_moe *b)
{
    const kt_moe_config *c = kt_moe_get_config(a);
    int same = 1;
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor wa, wb;
            OK(kt_moe_weight(a, e, (kt_moe_proj)p, &wa));
            OK(kt_moe_weight(b, e, (kt_moe_proj)p, &wb));
            same &= tu_bitwise_equal(&wa, &wb);
            for (int k = 0; c->mode == KT_MOE_LORA && k < 2; k++) {
                OK(kt_moe_lora(a, e, (kt_moe_proj)p, k, &wa));
                OK(kt_moe_lora(b, e, (kt_moe_proj)p, k, &wb));
                same &= tu_bitwise_equal(&wa, &wb);
            }
        }
    return same;
}

/* The file holds the layer's tensors under exactly the scheme's names (and nothing else). */
static void expect_names(const char *path, kt_moe_names names, int layer, kt_moe_mode mode,
                         int64_t inter, size_t also)
{
    static const char *const suffix[3] = {"weight", "lora_A.weight", "lora_B.weight"};
    kt_st_file *f;
    OK(kt_st_open(path, &f));
    const int kinds = mode == KT_MOE_LORA ? 3 : 1;
    assert_int_equal(kt_st_count(f), (size_t)(E * 3 * kinds) + also);
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++)
            for (int k = 0; k < kinds; k++) {
                char name[256];
                kt_tensor v;
                OK(kt_moe_tensor_name(names, layer, e, (kt_moe_proj)p, suffix[k], name,
                                      sizeof name));
                OK(kt_st_find(f, name, &v));
                const int64_t out = p == KT_MOE_DOWN ? H : inter;
                const int64_t in = p == KT_MOE_DOWN ? inter : H;
                assert_int_equal(v.shape[0], k == 1 ? 4 : out);
                assert_int_equal(v.shape[1], k == 2 ? 4 : in);
            }
    kt_st_close(f);
}

/* kt_moe_save / kt_moe_load with prefix NULL: the layer's own names, each scheme and mode. */
static void test_layer_round_trip(void **state)
{
    (void)state;
    char path[64];
    temp_path(path, sizeof path);
    for (int names = 0; names < 3; names++)
        for (int mode = 0; mode < 3; mode++) {
            kt_moe_config c = layer_cfg((kt_moe_mode)mode, KT_F32, (kt_moe_names)names, 9);
            kt_moe *a = NULL, *b = NULL;
            OK(kt_moe_create(&c, NULL, &a));
            OK(kt_moe_create(&c, NULL, &b));
            fill_layer(a, 10 + (uint64_t)mode);
            assert_false(same_layer(a, b));
            OK(kt_moe_save(a, path, NULL));
            expect_names(path, (kt_moe_names)names, 9, (kt_moe_mode)mode, I, 0);
            kt_st_file *f;
            OK(kt_st_open(path, &f));
            OK(kt_moe_load(b, f, NULL));
            kt_st_close(f);
            assert_true(same_layer(a, b));
            kt_moe_destroy(a);
            kt_moe_destroy(b);
        }
    /* two layers of different schemes in one file, each back under its own names */
    kt_moe_config ch = layer_cfg(KT_MOE_LORA, KT_BF16, KT_MOE_NAMES_HF, 1);
    kt_moe_config cm = layer_cfg(KT_MOE_LORA, KT_BF16, KT_MOE_NAMES_MIXTRAL, 1);
    kt_moe *h = NULL, *m = NULL, *h2 = NULL, *m2 = NULL;
    OK(kt_moe_create(&ch, NULL, &h));
    OK(kt_moe_create(&cm, NULL, &m));
    OK(kt_moe_create(&ch, NULL, &h2));
    OK(kt_moe_create(&cm, NULL, &m2));
    fill_layer(h, 1);
    fill_layer(m, 2);
    const kt_moe *both[2] = {h, m};
    OK(kt_moe_save_layers(both, NULL, 2, path));
    kt_st_file *f;
    OK(kt_st_open(path, &f));
    assert_int_equal(kt_st_count(f), 2 * E * 3 * 3);
    OK(kt_moe_load(h2, f, NULL));
    OK(kt_moe_load(m2, f, NULL));
    /* the prefix form still reads Hugging Face's projection names under any prefix */
    OK(kt_moe_load(h2, f, "model.layers.1.mlp."));
    kt_st_close(f);
    assert_true(same_layer(h, h2));
    assert_true(same_layer(m, m2));
    /* the same scheme and layer twice: refused, naming the duplicate */
    const kt_moe *twice[2] = {h, h2};
    TU_EXPECT_ERROR(kt_moe_save_layers(twice, NULL, 2, path), KT_EINVAL,
                    "'model.layers.1.mlp.experts.0.", "appears twice");
    kt_moe_destroy(h), kt_moe_destroy(m), kt_moe_destroy(h2), kt_moe_destroy(m2);
    /* a config naming an unknown scheme or a layer out of range is refused */
    kt_moe_config bad = layer_cfg(KT_MOE_FROZEN, KT_F32, (kt_moe_names)7, 0);
    kt_moe *x = NULL;
    TU_EXPECT_ERROR(kt_moe_create(&bad, NULL, &x), KT_EINVAL, "unknown tensor names 7");
    bad = layer_cfg(KT_MOE_FROZEN, KT_F32, KT_MOE_NAMES_HF, KT_MOE_MAX_LAYERS);
    TU_EXPECT_ERROR(kt_moe_create(&bad, NULL, &x), KT_EINVAL, "layer 4096");
    assert_null(x);
    unlink(path);
}

/* ---- programs ---------------------------------------------------------------------------- */

typedef struct op_spec {
    int layer;
    kt_moe_names names;
    int64_t intermediate;
} op_spec;

/* h = x; per spec: h = h + moe(h, topk_router(h W_r)); loss = CE(h W_head, y). */
static kt_program *compile_specs(const op_spec *specs, int n)
{
    kt_graph *g;
    kt_value x, y, h, head, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(T, H), &x));
    OK(kt_graph_input(g, "y", KT_I64, 1, TU_SHAPE(T), &y));
    h = x;
    for (int l = 0; l < n; l++) {
        char name[32];
        kt_value wr, r, out[2], in3[3], m;
        snprintf(name, sizeof name, "router%d", specs[l].layer);
        OK(kt_graph_param(g, name, KT_F32, 2, TU_SHAPE(H, E), kt_init_normal(0.5f), &wr));
        r = tu_op2(g, NULL, KT_OP_MATMUL, NULL, h, wr);
        kt_op_attrs ra = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = K, .norm_topk = 1);
        OK(kt_graph_op(g, NULL, KT_OP_TOPK_ROUTER, &ra, &r, 1, out));
        in3[0] = h, in3[1] = out[0], in3[2] = out[1];
        kt_op_attrs ma = TU_ATTRS(KT_OP_MOE, .binding = specs[l].layer,
                                  .moe_intermediate = specs[l].intermediate,
                                  .moe_names = specs[l].names);
        snprintf(name, sizeof name, "moe%d", specs[l].layer);
        OK(kt_graph_op(g, name, KT_OP_MOE, &ma, in3, 3, &m));
        h = tu_op2(g, NULL, KT_OP_ADD, NULL, h, m);
    }
    OK(kt_graph_param(g, "head", KT_F32, 2, TU_SHAPE(H, V), kt_init_normal(0.3f), &head));
    logits = tu_op2(g, NULL, KT_OP_MATMUL, NULL, h, head);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* DeepSeek-like: layers 0 and 1 dense (no moe op), layer 2 in hf names, layer 4 in Mixtral's
 * (layer 3 dense too); layer 2 says its intermediate size, layer 4 leaves it open. */
static const op_spec holes[2] = {{2, KT_MOE_NAMES_HF, I}, {4, KT_MOE_NAMES_MIXTRAL, 0}};

static void test_program_info(void **state)
{
    (void)state;
    kt_program *p = compile_specs(holes, 2);
    assert_int_equal(kt_program_moe_count(p), 2);
    kt_program_moe info;
    OK(kt_program_moe_info(p, 0, &info));
    assert_int_equal(info.binding, 2);
    assert_int_equal(info.intermediate, I);
    assert_int_equal(info.names, KT_MOE_NAMES_HF);
    kt_moe_config c;
    /* the program's size wins; the same value or 0 from the caller is fine */
    OK(kt_program_moe_config(&info, 0, KT_F32, KT_MOE_FULL, 0, 0.0f, 1, &c));
    assert_int_equal(c.intermediate, I);
    assert_int_equal(c.names, KT_MOE_NAMES_HF);
    assert_int_equal(c.layer, 2);
    OK(kt_program_moe_config(&info, I, KT_F32, KT_MOE_FULL, 0, 0.0f, 1, &c));
    TU_EXPECT_ERROR(kt_program_moe_config(&info, 2 * I, KT_F32, KT_MOE_FULL, 0, 0.0f, 1, &c),
                    KT_EINVAL, "moe node 'moe2'", "intermediate size 12, not 24");
    OK(kt_program_moe_info(p, 1, &info));
    assert_int_equal(info.binding, 4);
    assert_int_equal(info.intermediate, 0);
    assert_int_equal(info.names, KT_MOE_NAMES_MIXTRAL);
    OK(kt_program_moe_config(&info, 20, KT_F32, KT_MOE_FULL, 0, 0.0f, 1, &c));
    assert_int_equal(c.intermediate, 20);
    TU_EXPECT_ERROR(kt_program_moe_config(&info, 0, KT_F32, KT_MOE_FULL, 0, 0.0f, 1, &c),
                    KT_EINVAL, "moe node 'moe4'", "must be >= 1");
    /* the attributes survive a .ktp round trip */
    size_t size;
    OK(kt_program_serialized_size(p, &size));
    void *buf = malloc(size);
    OK(kt_program_serialize(p, buf, size));
    kt_program *q;
    OK(kt_program_load_memory(buf, size, &q));
    OK(kt_program_moe_info(q, 0, &info));
    assert_int_equal(info.intermediate, I);
    assert_int_equal(info.names, KT_MOE_NAMES_HF);
    kt_program_destroy(q);
    free(buf);
    kt_program_destroy(p);
}

static kt_moe_layers make_layers(const kt_program *p, kt_moe_mode mode, uint64_t seed)
{
    kt_moe_layers_options o = {.weight_dtype = KT_F32, .mode = mode, .lora_rank = 4,
                               .lora_alpha = 8.0f, .intermediate = I + 4};
    kt_moe_layers m;
    OK(kt_moe_layers_create(p, &o, NULL, &m));
    OK(kt_moe_layers_init(&m, seed));
    for (int b = 0; b < m.n; b++)
        if (m.layers[b] != NULL && mode == KT_MOE_LORA)
            fill_layer(m.layers[b], seed + (uint64_t)b); /* adapters not at their init */
    return m;
}

static kt_session *make_session(const kt_program *p, const kt_moe_layers *m)
{
    kt_session_options so = {.threads = 1, .seed = 5, .moe_layers = m->layers,
                             .n_moe_layers = m->n,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s;
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, V);
    return s;
}

/* The layers for bindings with holes: NULL slots where no moe op runs; sessions, forward and
 * backward run; the op's intermediate and the fallback size each op its own. */
static void test_holes(void **state)
{
    (void)state;
    kt_program *p = compile_specs(holes, 2);
    kt_moe_layers m = make_layers(p, KT_MOE_FULL, 3);
    assert_int_equal(m.n, 5);
    assert_int_equal(m.n_ops, 2);
    for (int b = 0; b < 5; b++)
        assert_int_equal(m.layers[b] != NULL, b == 2 || b == 4);
    assert_int_equal(kt_moe_get_config(m.layers[2])->intermediate, I);
    assert_int_equal(kt_moe_get_config(m.layers[4])->intermediate, I + 4);
    assert_int_equal(kt_moe_get_config(m.layers[4])->names, KT_MOE_NAMES_MIXTRAL);
    assert_int_equal(kt_moe_get_config(m.layers[4])->layer, 4);
    kt_session *s = make_session(p, &m);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    kt_tensor g;
    OK(kt_moe_weight_grad(m.layers[4], 1, KT_MOE_DOWN, &g));
    double sum = 0;
    for (int64_t i = 0; i < kt_tensor_numel(&g); i++)
        sum += ((const float *)g.data)[i] * ((const float *)g.data)[i];
    assert_true(sum > 0);
    kt_session_destroy(s);
    /* no size for an op that leaves it open: refused, naming the op */
    kt_moe_layers_options o = {.weight_dtype = KT_F32, .mode = KT_MOE_FROZEN};
    kt_moe_layers none;
    TU_EXPECT_ERROR(kt_moe_layers_create(p, &o, NULL, &none), KT_EINVAL, "moe node 'moe4'",
                    "none was given");
    assert_null(none.layers);
    uint64_t bytes = 0;
    o.intermediate = I;
    OK(kt_moe_layers_memory_need(p, &o, 2, &bytes));
    assert_true(bytes >= 2ull * E * 3 * H * I * 4);
    /* a layer whose size differs from what its op is written for: the session refuses it */
    kt_moe_config wrong = *kt_moe_get_config(m.layers[2]);
    wrong.intermediate = I + 2;
    wrong.name = "wrong";
    wrong.scratch = NULL;
    kt_moe *w = NULL;
    OK(kt_moe_create(&wrong, NULL, &w));
    kt_moe *layers[5] = {NULL, NULL, w, NULL, m.layers[4]};
    kt_session_options so = {.threads = 1, .moe_layers = layers, .n_moe_layers = 5};
    TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EINVAL, "moe node 'moe2'",
                    "intermediate size 12", "has 14");
    kt_moe_destroy(w);
    kt_moe_layers_destroy(&m);
    assert_null(m.layers);
    kt_moe_layers_destroy(&m); /* twice: a no-op */
    kt_program_destroy(p);
}

/* kt_session_save names each layer by its op's names; kt_session_load reads them back, in
 * every mode; a kt.moe_layers-less checkpoint with the names (an imported model's) loads too. */
static void test_session_round_trip(void **state)
{
    (void)state;
    char path[64];
    temp_path(path, sizeof path);
    kt_program *p = compile_specs(holes, 2);
    for (int mode = 0; mode < 3; mode++) {
        kt_moe_layers a = make_layers(p, (kt_moe_mode)mode, 11);
        kt_moe_layers b = make_layers(p, (kt_moe_mode)mode, 12);
        kt_session *sa = make_session(p, &a), *sb = make_session(p, &b);
        assert_false(same_layer(a.layers[2], b.layers[2]));
        OK(kt_session_save(sa, path, 0));
        /* the 3 parameters, layer 4's tensors and layer 2's (checked by name) */
        const size_t per_layer = (size_t)(E * 3 * (mode == KT_MOE_LORA ? 3 : 1));
        expect_names(path, KT_MOE_NAMES_HF, 2, (kt_moe_mode)mode, I, 3 + per_layer);
        expect_names(path, KT_MOE_NAMES_MIXTRAL, 4, (kt_moe_mode)mode, I + 4, 3 + per_layer);
        kt_st_file *f;
        OK(kt_st_open(path, &f));
        kt_tensor v;
        OK(kt_st_find(f, "model.layers.4.block_sparse_moe.experts.3.w3.weight", &v));
        assert_string_equal(kt_st_metadata(f, "kt.moe_layers"), "2,4");
        kt_st_close(f);
        OK(kt_session_load(sb, path, 0));
        assert_true(same_layer(a.layers[2], b.layers[2]));
        assert_true(same_layer(a.layers[4], b.layers[4]));
        kt_session_destroy(sa);
        kt_session_destroy(sb);
        kt_moe_layers_destroy(&a);
        kt_moe_layers_destroy(&b);
    }
    unlink(path);
    kt_program_destroy(p);
}

/* What a file of expert tensors holds, written by hand (an imported checkpoint). */
typedef struct file_spec {
    int skip_expert;     /* leave out this expert's up weight (-1: none) */
    int misshapen;       /* layer 2's expert 1 gate [I, H + 1] */
    int extra_expert;    /* add expert E to layer 2 */
    kt_dtype dtype;      /* of the expert weights */
} file_spec;

static void write_checkpoint(const char *path, kt_session *s, const kt_moe_layers *m,
                             const file_spec *fs)
{
    kt_st_item items[64];
    char names[64][128];
    kt_tensor owned[64];
    size_t n = 0, n_owned = 0;
    static const char *const params[3] = {"router2", "router4", "head"};
    for (int i = 0; i < 3; i++) {
        items[n].name = params[i];
        OK(kt_session_tensor(s, KT_ROLE_PARAM, params[i], &items[n].tensor));
        n++;
    }
    const int layers[2] = {2, 4};
    for (int l = 0; l < 2; l++)
        for (int64_t e = 0; e < E + (l == 0 && fs->extra_expert); e++)
            for (int p = 0; p < 3; p++) {
                if (e == fs->skip_expert && p == KT_MOE_UP && l == 1)
                    continue;
                kt_tensor w;
                OK(kt_moe_weight(m->layers[layers[l]], e < E ? e : 0, (kt_moe_proj)p, &w));
                if (fs->misshapen && l == 0 && e == 1 && p == KT_MOE_GATE)
                    owned[n_owned] = tu_new(KT_F32, I, H + 1);
                else
                    owned[n_owned] = tu_convert(&w, fs->dtype);
                OK(kt_moe_tensor_name(holes[l].names, layers[l], e, (kt_moe_proj)p, "weight",
                                      names[n], sizeof names[n]));
                items[n].name = names[n];
                items[n].tensor = owned[n_owned++];
                n++;
            }
    OK(kt_st_save(path, items, n, NULL));
    for (size_t i = 0; i < n_owned; i++)
        tu_free(&owned[i]);
}

/* A checkpoint in the models' own names (no kt.moe_layers metadata) loads into a session;
 * stored bf16 experts are converted to the layers' f32; a missing, misshapen or extra expert
 * tensor is an error naming the file and the tensor, and changes nothing. */
static void test_session_checkpoint_errors(void **state)
{
    (void)state;
    char path[64];
    temp_path(path, sizeof path);
    kt_program *p = compile_specs(holes, 2);
    kt_moe_layers a = make_layers(p, KT_MOE_FROZEN, 21);
    kt_moe_layers b = make_layers(p, KT_MOE_FROZEN, 22);
    kt_session *sa = make_session(p, &a), *sb = make_session(p, &b);

    file_spec good = {.skip_expert = -1, .dtype = KT_F32};
    write_checkpoint(path, sa, &a, &good);
    OK(kt_session_load(sb, path, 0));
    assert_true(same_layer(a.layers[2], b.layers[2]));
    assert_true(same_layer(a.layers[4], b.layers[4]));

    /* bf16 on disk into f32 experts: each value the bf16 rounding of a's */
    file_spec bf16 = good;
    bf16.dtype = KT_BF16;
    write_checkpoint(path, sa, &a, &bf16);
    OK(kt_session_load(sb, path, 0));
    kt_tensor wa, wb;
    OK(kt_moe_weight(a.layers[4], 3, KT_MOE_DOWN, &wa));
    OK(kt_moe_weight(b.layers[4], 3, KT_MOE_DOWN, &wb));
    kt_tensor rounded = tu_convert(&wa, KT_BF16), back = tu_convert(&rounded, KT_F32);
    assert_true(tu_bitwise_equal(&back, &wb));
    assert_false(tu_bitwise_equal(&wa, &wb));
    tu_free(&rounded);
    tu_free(&back);

    /* the errors, on a session of its own */
    kt_moe_layers c = make_layers(p, KT_MOE_FROZEN, 22);
    kt_session *sc = make_session(p, &c);
    file_spec missing = good, misshapen = good, extra = good;
    missing.skip_expert = 2;
    write_checkpoint(path, sa, &a, &missing);
    TU_EXPECT_ERROR(kt_session_load(sc, path, 0), KT_EINVAL, path, "MoE layer 4",
                    "model.layers.4.block_sparse_moe.experts.2.w3.weight");
    misshapen.misshapen = 1;
    write_checkpoint(path, sa, &a, &misshapen);
    TU_EXPECT_ERROR(kt_session_load(sc, path, 0), KT_EINVAL, path, "MoE layer 2",
                    "model.layers.2.mlp.experts.1.gate_proj.weight", "f32[12,17]");
    extra.extra_expert = 1;
    write_checkpoint(path, sa, &a, &extra);
    TU_EXPECT_ERROR(kt_session_load(sc, path, 0), KT_EINVAL, path,
                    "model.layers.2.mlp.experts.4.gate_proj.weight", "not a parameter");
    /* ... unless unused tensors are allowed */
    OK(kt_session_load(sc, path, KT_LOAD_ALLOW_UNUSED));
    assert_true(same_layer(a.layers[2], c.layers[2]));
    kt_session_destroy(sa), kt_session_destroy(sb), kt_session_destroy(sc);
    kt_moe_layers_destroy(&a), kt_moe_layers_destroy(&b), kt_moe_layers_destroy(&c);
    kt_program_destroy(p);
    unlink(path);
}

/* kt_moe_layers_load (kt-train --experts): every layer under its names, nothing else. */
static void test_layers_load(void **state)
{
    (void)state;
    char path[64];
    temp_path(path, sizeof path);
    kt_program *p = compile_specs(holes, 2);
    for (int mode = 0; mode < 3; mode++) {
        kt_moe_layers a = make_layers(p, (kt_moe_mode)mode, 31);
        kt_moe_layers b = make_layers(p, (kt_moe_mode)mode, 32);
        const kt_moe *both[2] = {a.layers[2], a.layers[4]};
        OK(kt_moe_save_layers(both, NULL, 2, path));
        OK(kt_moe_layers_load(&b, path));
        assert_true(same_layer(a.layers[2], b.layers[2]));
        assert_true(same_layer(a.layers[4], b.layers[4]));
        kt_moe_layers_destroy(&a);
        kt_moe_layers_destroy(&b);
    }
    /* LoRA adapters for layers that are not in LoRA mode: the first is named */
    kt_moe_layers lora = make_layers(p, KT_MOE_LORA, 33);
    kt_moe_layers full = make_layers(p, KT_MOE_FULL, 34);
    const kt_moe *both[2] = {lora.layers[2], lora.layers[4]};
    OK(kt_moe_save_layers(both, NULL, 2, path));
    TU_EXPECT_ERROR(kt_moe_layers_load(&full, path), KT_EINVAL, path,
                    "'model.layers.2.mlp.experts.0.gate_proj.lora_A.weight' is not one this run "
                    "loads");
    /* one layer's experts only: the other's first tensor is named */
    OK(kt_moe_save(lora.layers[2], path, NULL));
    TU_EXPECT_ERROR(kt_moe_layers_load(&lora, path), KT_EINVAL, path, "MoE layer 4",
                    "model.layers.4.block_sparse_moe.experts.0.w1.weight");
    kt_moe_layers_destroy(&lora);
    kt_moe_layers_destroy(&full);
    kt_program_destroy(p);
    unlink(path);
}

/* The names against what transformers writes (tests/hf/fixtures, save_pretrained): a layer
 * of each scheme loads every expert of the checkpoint's MoE layer with no prefix, and holds
 * the checkpoint's bytes; sizes are read off the file (E: the experts listed, I and H: the
 * gate's shape). */
static void test_transformers_names(void **state)
{
    (void)state;
    static const struct {
        const char *arch;
        kt_moe_names names;
        int layer; /* deepseek_v2's layer 0 is dense */
    } cases[] = {{"mixtral", KT_MOE_NAMES_MIXTRAL, 0}, {"qwen2_moe", KT_MOE_NAMES_HF, 1},
                 {"qwen3_moe", KT_MOE_NAMES_HF, 0},    {"olmoe", KT_MOE_NAMES_HF, 1},
                 {"deepseek_v2", KT_MOE_NAMES_HF, 1},  {"deepseek_v3", KT_MOE_NAMES_HF, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[1024], name[256];
        snprintf(path, sizeof path, "%s/tests/hf/fixtures/%s/model.safetensors", KT_SOURCE_DIR,
                 cases[i].arch);
        kt_st_file *f = NULL;
        if (access(path, R_OK) != 0)
            fail_msg("%s: %s is not there (the fixtures are committed)", cases[i].arch, path);
        OK(kt_st_open(path, &f));
        int64_t n_experts = 0;
        kt_tensor gate, probe;
        for (;; n_experts++) {
            OK(kt_moe_tensor_name(cases[i].names, cases[i].layer, n_experts, KT_MOE_GATE,
                                  "weight", name, sizeof name));
            if (kt_st_find(f, name, n_experts == 0 ? &gate : &probe) != KT_OK)
                break;
        }
        kt_clear_error();
        assert_true(n_experts >= 2);
        kt_moe_config c = layer_cfg(KT_MOE_FROZEN, KT_F32, cases[i].names, cases[i].layer);
        c.n_experts = n_experts, c.intermediate = gate.shape[0], c.hidden = gate.shape[1];
        kt_moe *m = NULL;
        OK(kt_moe_create(&c, NULL, &m));
        OK(kt_moe_load(m, f, NULL));
        kt_tensor w;
        OK(kt_moe_weight(m, n_experts - 1, KT_MOE_DOWN, &w));
        kt_tensor want = tu_clone(&w);
        OK(kt_moe_tensor_name(cases[i].names, cases[i].layer, n_experts - 1, KT_MOE_DOWN,
                              "weight", name, sizeof name));
        OK(kt_st_read(f, name, &want));
        assert_true(tu_bitwise_equal(&w, &want));
        print_message("%s: %lld experts of [%lld, %lld] under %s\n", cases[i].arch,
                      (long long)n_experts, (long long)c.intermediate, (long long)c.hidden,
                      name);
        tu_free(&want);
        kt_moe_destroy(m);
        kt_st_close(f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tensor_name),
        cmocka_unit_test(test_layer_round_trip),
        cmocka_unit_test(test_program_info),
        cmocka_unit_test(test_holes),
        cmocka_unit_test(test_session_round_trip),
        cmocka_unit_test(test_session_checkpoint_errors),
        cmocka_unit_test(test_layers_load),
        cmocka_unit_test(test_transformers_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
