/* kt-demo: trains a two-layer MLP classifier by calling libkt's op kernels directly.
 *
 *   logits = silu(x W1 + b1) W2 + b2,   loss = cross_entropy(logits, labels)
 *
 * The data are points drawn around C random centres in D dimensions; the label is the
 * centre. Every buffer comes from one arena sized up front, so the training loop allocates
 * nothing — the same discipline the compiled graph follows. Until the graph and the trainer
 * exist, this is what "a real training run" looks like from C.
 *
 * usage: kt-demo [--steps N] [--threads T] [--lr X]
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

enum { N = 2048, D = 32, H = 128, C = 8 };

static void die_on(kt_status s, const char *what)
{
    if (s != KT_OK) {
        fprintf(stderr, "kt-demo: %s: %s (%s)\n", what, kt_last_error(), kt_status_str(s));
        exit(1);
    }
}

static kt_arena arena;

static kt_tensor new_tensor(kt_dtype dtype, int64_t rows, int64_t cols)
{
    kt_tensor t;
    int64_t shape[2] = {rows, cols};
    int ndim = cols > 0 ? 2 : (rows > 0 ? 1 : 0);
    die_on(kt_tensor_init(&t, NULL, dtype, ndim, shape), "tensor");
    die_on(kt_arena_alloc(&arena, kt_tensor_nbytes(&t) ? kt_tensor_nbytes(&t) : 4, 64, &t.data),
           "arena");
    memset(t.data, 0, kt_tensor_nbytes(&t));
    return t;
}

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static double uniform(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}

static double normal(void)
{
    return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform());
}

static void fill_normal(kt_tensor *t, double std)
{
    float *p = t->data;
    for (int64_t i = 0; i < kt_tensor_numel(t); i++)
        p[i] = (float)(std * normal());
}

static void sgd(kt_tensor *p, const kt_tensor *g, float lr)
{
    float *pp = p->data;
    const float *gg = g->data;
    for (int64_t i = 0; i < kt_tensor_numel(p); i++)
        pp[i] -= lr * gg[i];
}

static int parse_args(int argc, char **argv, int *steps, int *threads, float *lr)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-demo [--steps N] [--threads T] [--lr X]\n"
                   "Trains a two-layer MLP classifier on synthetic clusters with libkt's\n"
                   "kernels and prints the loss and accuracy as it goes.\n");
            return -1;
        }
        const int known = strcmp(argv[i], "--steps") == 0 || strcmp(argv[i], "--threads") == 0 ||
                          strcmp(argv[i], "--lr") == 0;
        if (known && i + 1 >= argc) {
            fprintf(stderr, "kt-demo: %s needs a value (see --help)\n", argv[i]);
            return 1;
        }
        if (strcmp(argv[i], "--steps") == 0)
            *steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0)
            *threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--lr") == 0)
            *lr = (float)atof(argv[++i]);
        else {
            fprintf(stderr, "kt-demo: unknown option %s (see --help)\n", argv[i]);
            return 1;
        }
    }
    if (*steps <= 0 || *lr <= 0) {
        fprintf(stderr, "kt-demo: --steps and --lr must be positive\n");
        return 1;
    }
    return 0;
}

static int demo(int argc, char **argv)
{
    int steps = 200, threads = 0;
    float lr = 0.5f;
    int parsed = parse_args(argc, argv, &steps, &threads, &lr);
    if (parsed != 0)
        return parsed < 0 ? 0 : 2;

    die_on(kt_arena_create(&arena, 64u << 20, -1), "arena");
    kt_threadpool *pool = NULL;
    die_on(kt_threadpool_create(threads, &pool), "thread pool");

    /* data: N points around C centres */
    kt_tensor x = new_tensor(KT_F32, N, D), y = new_tensor(KT_I32, N, 0);
    kt_tensor centres = new_tensor(KT_F32, C, D);
    fill_normal(&centres, 1.0);
    for (int i = 0; i < N; i++) {
        int label = (int)(uniform() * C) % C;
        ((int32_t *)y.data)[i] = label;
        for (int d = 0; d < D; d++)
            ((float *)x.data)[i * D + d] =
                ((float *)centres.data)[label * D + d] + (float)(0.9 * normal());
    }

    /* parameters and their gradients */
    kt_tensor w1 = new_tensor(KT_F32, D, H), b1 = new_tensor(KT_F32, H, 0);
    kt_tensor w2 = new_tensor(KT_F32, H, C), b2 = new_tensor(KT_F32, C, 0);
    fill_normal(&w1, 1.0 / sqrt(D));
    fill_normal(&w2, 1.0 / sqrt(H));
    kt_tensor gw1 = new_tensor(KT_F32, D, H), gb1 = new_tensor(KT_F32, H, 0);
    kt_tensor gw2 = new_tensor(KT_F32, H, C), gb2 = new_tensor(KT_F32, C, 0);

    /* activations and their gradients */
    kt_tensor h0 = new_tensor(KT_F32, N, H), h1 = new_tensor(KT_F32, N, H);
    kt_tensor h2 = new_tensor(KT_F32, N, H), l0 = new_tensor(KT_F32, N, C);
    kt_tensor l1 = new_tensor(KT_F32, N, C), loss = new_tensor(KT_F32, 0, 0);
    kt_tensor g_loss = new_tensor(KT_F32, 0, 0), g_l1 = new_tensor(KT_F32, N, C);
    kt_tensor g_l0 = new_tensor(KT_F32, N, C), g_h2 = new_tensor(KT_F32, N, H);
    kt_tensor g_h1 = new_tensor(KT_F32, N, H), g_h0 = new_tensor(KT_F32, N, H);
    *(float *)g_loss.data = 1.0f;

    /* NULL attributes are the op's defaults; cross_entropy's ignore_index defaults to -100 */
    const kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    const kt_tensor in_mm1[2] = {x, w1}, in_b1[2] = {h0, b1}, in_mm2[2] = {h2, w2};
    const kt_tensor in_b2[2] = {l0, b2}, in_ce[2] = {l1, y};

    /* one scratch buffer, as large as the largest kernel needs */
    size_t scratch = 0;
    const struct {
        kt_op op;
        const kt_op_attrs *attrs;
        const kt_tensor *in;
    } calls[] = {{KT_OP_MATMUL, NULL, in_mm1}, {KT_OP_ADD, NULL, in_b1},
                 {KT_OP_SILU, NULL, &h1},      {KT_OP_MATMUL, NULL, in_mm2},
                 {KT_OP_ADD, NULL, in_b2},     {KT_OP_CROSS_ENTROPY, &ce, in_ce}};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        int n_in;
        die_on(kt_op_arity(calls[i].op, &n_in, NULL, NULL), "arity");
        for (int b = 0; b < 2; b++) {
            size_t s = kt_op_scratch_bytes(calls[i].op, calls[i].attrs, calls[i].in, n_in, b);
            scratch = s > scratch ? s : scratch;
        }
    }
    kt_exec ex = {.pool = pool, .scratch_bytes = scratch};
    if (scratch)
        die_on(kt_arena_alloc(&arena, scratch, 64, &ex.scratch), "scratch");

    printf("kt-demo: libkt %s, cpu: %s, %d thread(s); MLP %d-%d-%d on %d points\n",
           kt_version_string(), kt_cpu_describe(), kt_threadpool_size(pool), D, H, C, N);
    float first = 0.0f, last = 0.0f;
    for (int step = 0; step < steps; step++) {
        die_on(kt_op_forward(KT_OP_MATMUL, NULL, in_mm1, 2, &h0, 1, &ex), "matmul 1");
        die_on(kt_op_forward(KT_OP_ADD, NULL, in_b1, 2, &h1, 1, &ex), "bias 1");
        die_on(kt_op_forward(KT_OP_SILU, NULL, &h1, 1, &h2, 1, &ex), "silu");
        die_on(kt_op_forward(KT_OP_MATMUL, NULL, in_mm2, 2, &l0, 1, &ex), "matmul 2");
        die_on(kt_op_forward(KT_OP_ADD, NULL, in_b2, 2, &l1, 1, &ex), "bias 2");
        die_on(kt_op_forward(KT_OP_CROSS_ENTROPY, &ce, in_ce, 2, &loss, 1, &ex), "loss");

        kt_tensor g_ce[2] = {g_l1, {0}}, g_add2[2] = {g_l0, gb2}, g_mm2[2] = {g_h2, gw2};
        kt_tensor g_add1[2] = {g_h0, gb1}, g_mm1[2] = {{0}, gw1};
        die_on(kt_op_backward(KT_OP_CROSS_ENTROPY, &ce, in_ce, 2, &loss, 1, &g_loss, g_ce, &ex),
               "loss backward");
        die_on(kt_op_backward(KT_OP_ADD, NULL, in_b2, 2, &l1, 1, &g_l1, g_add2, &ex),
               "bias 2 backward");
        die_on(kt_op_backward(KT_OP_MATMUL, NULL, in_mm2, 2, &l0, 1, &g_l0, g_mm2, &ex),
               "matmul 2 backward");
        die_on(kt_op_backward(KT_OP_SILU, NULL, &h1, 1, &h2, 1, &g_h2, &g_h1, &ex),
               "silu backward");
        die_on(kt_op_backward(KT_OP_ADD, NULL, in_b1, 2, &h1, 1, &g_h1, g_add1, &ex),
               "bias 1 backward");
        die_on(kt_op_backward(KT_OP_MATMUL, NULL, in_mm1, 2, &h0, 1, &g_h0, g_mm1, &ex),
               "matmul 1 backward");

        sgd(&w1, &gw1, lr), sgd(&b1, &gb1, lr), sgd(&w2, &gw2, lr), sgd(&b2, &gb2, lr);

        float value = *(const float *)loss.data;
        if (step == 0)
            first = value;
        last = value;
        if (step % 20 == 0 || step == steps - 1) {
            int correct = 0;
            for (int i = 0; i < N; i++) {
                const float *row = (const float *)l1.data + i * C;
                int best = 0;
                for (int c = 1; c < C; c++)
                    best = row[c] > row[best] ? c : best;
                correct += best == ((int32_t *)y.data)[i];
            }
            printf("step %4d  loss %.4f  accuracy %.3f\n", step, value, (double)correct / N);
        }
    }
    printf("kt-demo: loss %.4f -> %.4f over %d steps; arena high water %zu bytes\n", first,
           last, steps, arena.high_water);
    kt_threadpool_destroy(pool);
    kt_arena_destroy(&arena);
    return last < first ? 0 : 1;
}

int main(int argc, char **argv)
{
    int rc = demo(argc, argv);
    /* output redirected to a full disk or a closed pipe is a failure, not a quiet exit 0 */
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kt-demo: cannot write to standard output: %s\n",
                errno != 0 ? strerror(errno) : "an earlier write failed");
        return 1;
    }
    return rc;
}
