/* The fixture for the kt-run test (test_kt_run.sh).
 *
 *   make_fixture write DIR
 *       compiles a small MLP through the C API and writes into DIR: model.ktp (training),
 *       model_fwd.ktp (forward only), params.safetensors, inputs.safetensors, and the broken
 *       files of the error cases: inputs_missing (no "y"), inputs_shape (x has a wrong shape),
 *       inputs_dtype (y is f32), params_missing (no "w2"), corrupt.ktp (one byte flipped).
 *   make_fixture check OUT THREADS [backward]
 *       runs the same model in a session of its own (compiled here, values set directly, not
 *       read from the files) and compares OUT, written by kt-run, with it bitwise: the same
 *       names, dtypes, shapes and bytes (the outputs, the loss, with backward the
 *       gradients), and nothing else.
 *
 * Exit status 0 on success, 1 on a mismatch or error (with a message on stderr). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/io.h"
#include "kt/program.h"

enum { N = 8, D = 6, H = 10, C = 4 };

#define CHECK(expr)                                                                           \
    do {                                                                                      \
        if ((expr) != KT_OK) {                                                                \
            fprintf(stderr, "make_fixture: %s: %s\n", #expr, kt_last_error());                \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static kt_value op(kt_graph *g, const char *name, kt_op o, const kt_op_attrs *attrs,
                   kt_value a, kt_value b, int n_in)
{
    kt_value in[2] = {a, b}, out;
    CHECK(kt_graph_op(g, name, o, attrs, in, n_in, &out));
    return out;
}

/* loss = CE(silu(x w1 + b1) w2 + b2, y); b2 is frozen (no gradient). */
static kt_program *compile_mlp(int training)
{
    kt_graph *g;
    kt_value x, y, w1, b1, w2, b2, h, logits, loss;
    CHECK(kt_graph_create(&g));
    CHECK(kt_graph_input(g, "x", KT_F32, 2, (const int64_t[]){N, D}, &x));
    CHECK(kt_graph_input(g, "y", KT_I32, 1, (const int64_t[]){N}, &y));
    CHECK(kt_graph_param(g, "w1", KT_F32, 2, (const int64_t[]){D, H}, kt_init_normal(0.3f), &w1));
    CHECK(kt_graph_param(g, "b1", KT_F32, 1, (const int64_t[]){H}, kt_init_zeros(), &b1));
    CHECK(kt_graph_param(g, "w2", KT_F32, 2, (const int64_t[]){H, C}, kt_init_normal(0.3f), &w2));
    CHECK(kt_graph_const_param(g, "b2", KT_F32, 1, (const int64_t[]){C}, kt_init_zeros(), &b2));
    h = op(g, "fc1", KT_OP_MATMUL, NULL, x, w1, 2);
    h = op(g, "bias1", KT_OP_ADD, NULL, h, b1, 2);
    h = op(g, "act", KT_OP_SILU, NULL, h, h, 1);
    logits = op(g, "fc2", KT_OP_MATMUL, NULL, h, w2, 2);
    logits = op(g, "bias2", KT_OP_ADD, NULL, logits, b2, 2);
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ce.ignore_index = -100;
    loss = op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y, 2);
    CHECK(kt_graph_output(g, logits, "logits"));
    CHECK(kt_graph_output(g, h, "hidden"));
    CHECK(kt_graph_set_loss(g, loss));
    kt_compile_options co = {.training = training};
    kt_program *p;
    CHECK(kt_compile(g, &co, &p));
    kt_graph_destroy(g);
    return p;
}

/* The values: a formula of the tensor's name and the element index, exact in f32. */
static void fill(const char *name, kt_tensor *t)
{
    uint64_t seed = 0;
    for (const char *c = name; *c; c++)
        seed = seed * 31 + (unsigned char)*c;
    int64_t n = kt_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        int64_t k = (i * 7 + (int64_t)(seed % 11) * 3) % 13;
        if (t->dtype == KT_I32)
            ((int32_t *)t->data)[i] = (int32_t)(k % C);
        else
            ((float *)t->data)[i] = (float)(k - 6) * 0.125f;
    }
}

/* A heap tensor filled by the formula (dtype and shape may differ from the program's). */
static kt_st_item item(const char *name, kt_dtype dtype, int ndim, const int64_t *shape)
{
    kt_st_item it = {name, {0}};
    CHECK(kt_tensor_init(&it.tensor, NULL, dtype, ndim, shape));
    it.tensor.data = calloc(1, kt_tensor_nbytes(&it.tensor) + 1);
    if (it.tensor.data == NULL)
        exit(1);
    fill(name, &it.tensor);
    return it;
}

static void save(const char *dir, const char *file, kt_st_item *items, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    CHECK(kt_st_save(path, items, n, NULL));
}

static int write_fixture(const char *dir)
{
    char path[4096];
    kt_program *p = compile_mlp(1), *fwd = compile_mlp(0);
    snprintf(path, sizeof path, "%s/model.ktp", dir);
    CHECK(kt_program_save(p, path));
    snprintf(path, sizeof path, "%s/model_fwd.ktp", dir);
    CHECK(kt_program_save(fwd, path));

    kt_st_item params[4] = {item("w1", KT_F32, 2, (const int64_t[]){D, H}),
                            item("b1", KT_F32, 1, (const int64_t[]){H}),
                            item("b2", KT_F32, 1, (const int64_t[]){C}),
                            item("w2", KT_F32, 2, (const int64_t[]){H, C})};
    save(dir, "params.safetensors", params, 4);
    save(dir, "params_missing.safetensors", params, 3);
    kt_st_item inputs[2] = {item("x", KT_F32, 2, (const int64_t[]){N, D}),
                            item("y", KT_I32, 1, (const int64_t[]){N})};
    save(dir, "inputs.safetensors", inputs, 2);
    save(dir, "inputs_missing.safetensors", inputs, 1);
    kt_st_item bad_shape[2] = {item("x", KT_F32, 2, (const int64_t[]){N, D + 1}), inputs[1]};
    save(dir, "inputs_shape.safetensors", bad_shape, 2);
    kt_st_item bad_dtype[2] = {inputs[0], item("y", KT_F32, 1, (const int64_t[]){N})};
    save(dir, "inputs_dtype.safetensors", bad_dtype, 2);

    /* corrupt.ktp: model.ktp with one byte in the middle flipped */
    size_t size;
    CHECK(kt_program_serialized_size(p, &size));
    unsigned char *buf = malloc(size);
    if (buf == NULL)
        return 1;
    CHECK(kt_program_serialize(p, buf, size));
    buf[size / 2] ^= 0x40;
    snprintf(path, sizeof path, "%s/corrupt.ktp", dir);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(buf, 1, size, f) != size || fclose(f) != 0) {
        fprintf(stderr, "make_fixture: cannot write %s\n", path);
        return 1;
    }
    free(buf);
    for (int i = 0; i < 4; i++)
        free(params[i].tensor.data);
    for (int i = 0; i < 2; i++)
        free(inputs[i].tensor.data);
    free(bad_shape[0].tensor.data);
    free(bad_dtype[1].tensor.data);
    kt_program_destroy(p);
    kt_program_destroy(fwd);
    return 0;
}

/* Compares the file's tensor `name` with `want` bitwise; 1 on a mismatch. */
static int compare(const kt_st_file *f, const char *name, const kt_tensor *want)
{
    kt_tensor got;
    if (kt_st_find(f, name, &got) != KT_OK) {
        fprintf(stderr, "make_fixture: '%s' is missing from the output\n", name);
        return 1;
    }
    char a[96], b[96];
    if (got.dtype != want->dtype || !kt_tensor_same_shape(&got, want)) {
        fprintf(stderr, "make_fixture: '%s' is %s, expected %s\n", name,
                kt_tensor_describe(&got, a, sizeof a), kt_tensor_describe(want, b, sizeof b));
        return 1;
    }
    size_t bytes = kt_tensor_nbytes(want);
    if (bytes > 0 && memcmp(got.data, want->data, bytes) != 0) {
        const unsigned char *g = got.data, *w = want->data;
        size_t at = 0;
        while (g[at] == w[at])
            at++;
        fprintf(stderr, "make_fixture: '%s' differs from the session's result (first at byte "
                        "%zu of %zu)\n", name, at, bytes);
        return 1;
    }
    return 0;
}

static kt_tensor view(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    CHECK(kt_session_tensor(s, role, name, &t));
    return t;
}

static int check(const char *out_path, int threads, int backward)
{
    kt_program *p = compile_mlp(1);
    kt_session_options so;
    memset(&so, 0, sizeof so);
    so.threads = threads;
    kt_session *s;
    CHECK(kt_session_create(p, &so, &s));
    static const char *const params[] = {"w1", "b1", "w2", "b2"};
    static const char *const inputs[] = {"x", "y"};
    for (int i = 0; i < 4; i++) {
        kt_tensor t = view(s, KT_ROLE_PARAM, params[i]);
        fill(params[i], &t);
    }
    for (int i = 0; i < 2; i++) {
        kt_tensor t = view(s, KT_ROLE_INPUT, inputs[i]);
        fill(inputs[i], &t);
    }
    CHECK(kt_session_forward(s));
    /* copies of the outputs, taken before backward */
    static const char *const outputs[] = {"logits", "hidden"};
    kt_tensor out[2];
    for (int i = 0; i < 2; i++) {
        kt_tensor v = view(s, KT_ROLE_OUTPUT, outputs[i]);
        CHECK(kt_tensor_init(&out[i], malloc(kt_tensor_nbytes(&v)), v.dtype, v.ndim, v.shape));
        memcpy(out[i].data, v.data, kt_tensor_nbytes(&v));
    }
    float loss = kt_session_loss(s);
    if (backward)
        CHECK(kt_session_backward(s));

    kt_st_file *f;
    CHECK(kt_st_open(out_path, &f));
    int bad = 0;
    size_t expected = 2;
    for (int i = 0; i < 2; i++)
        bad |= compare(f, outputs[i], &out[i]);
    if (backward) {
        static const char *const grads[] = {"w1", "b1", "w2"}; /* b2 is frozen */
        for (int i = 0; i < 3; i++) {
            char name[64];
            snprintf(name, sizeof name, "grad.%s", grads[i]);
            kt_tensor g = view(s, KT_ROLE_GRAD, grads[i]);
            bad |= compare(f, name, &g);
        }
        expected += 3;
    }
    kt_tensor l; /* written by forward too */
    CHECK(kt_tensor_init(&l, &loss, KT_F32, 0, NULL));
    bad |= compare(f, "loss", &l);
    expected += 1;
    if (kt_st_count(f) != expected) {
        fprintf(stderr, "make_fixture: the output holds %zu tensors, expected %zu\n",
                kt_st_count(f), expected);
        bad = 1;
    }
    if (!bad)
        fprintf(stderr, "make_fixture: %s matches the session bitwise (%zu tensors)\n",
                out_path, expected);
    kt_st_close(f);
    for (int i = 0; i < 2; i++)
        free(out[i].data);
    kt_session_destroy(s);
    kt_program_destroy(p);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "write") == 0)
        return write_fixture(argv[2]);
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "check") == 0 &&
        (argc == 4 || strcmp(argv[4], "backward") == 0))
        return check(argv[2], atoi(argv[3]), argc == 5);
    fprintf(stderr, "usage: make_fixture write DIR | make_fixture check OUT THREADS [backward]\n");
    return 2;
}
