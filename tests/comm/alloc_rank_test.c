/* Zero allocations by libkt in the steady state, one rank under kt-launch (run_alloc_tests.sh):
 *
 *   alloc_rank_test session      a training session with a gradient all-reduce (matmul,
 *                                cross-entropy, AdamW): forward / backward / step
 *   alloc_rank_test collectives  every collective (all_reduce small and large, f32 and bf16,
 *                                reduce_scatter, all_gather, all_to_all_v, agree with and
 *                                without a failure, broadcast, barrier)
 *
 * Each is warmed up first, then the calls of malloc, calloc, realloc, posix_memalign,
 * aligned_alloc and memalign are counted over later calls: those made from libkt's code (and
 * the test's) must be 0; those made inside UCX are counted and printed. Counting: this
 * binary defines those functions over glibc's __libc_* ones (not under AddressSanitizer,
 * which owns malloc: there the scenarios run uncounted).
 * Prints "PASS rank r" or "FAIL rank r: why". */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <kt/kt.h>

#include "tests/comm/rank_check.h"

static atomic_int g_counting;
static atomic_long g_allocs, g_ucx_allocs;

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

#ifdef UNDER_ASAN
/* AddressSanitizer owns malloc: the scenarios run (and check their results), uncounted. */
static const int g_can_count = 0;
#else
static const int g_can_count = 1;
/* This binary's code: libkt (linked statically) and the test. An allocation called from
 * anywhere else (UCX's own pools, registration and wireup, glibc) is counted apart. */
extern char __executable_start, etext;

static void counted(const void *caller)
{
    if (!atomic_load_explicit(&g_counting, memory_order_relaxed))
        return;
    const char *p = caller;
    if (p >= &__executable_start && p < &etext)
        atomic_fetch_add_explicit(&g_allocs, 1, memory_order_relaxed);
    else
        atomic_fetch_add_explicit(&g_ucx_allocs, 1, memory_order_relaxed);
}

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
void *memalign(size_t a, size_t n);

#define CALLER __builtin_return_address(0)
void *malloc(size_t n)
{
    counted(CALLER);
    return __libc_malloc(n);
}
void *calloc(size_t n, size_t m)
{
    counted(CALLER);
    return __libc_calloc(n, m);
}
void *realloc(void *p, size_t n)
{
    counted(CALLER);
    return __libc_realloc(p, n);
}
void free(void *p) { __libc_free(p); }
void *memalign(size_t a, size_t n)
{
    counted(CALLER);
    return __libc_memalign(a, n);
}
void *aligned_alloc(size_t a, size_t n)
{
    counted(CALLER);
    return __libc_memalign(a, n);
}
int posix_memalign(void **out, size_t a, size_t n)
{
    counted(CALLER);
    if (a < sizeof(void *) || (a & (a - 1)) != 0)
        return 22; /* EINVAL */
    void *p = __libc_memalign(a, n);
    if (p == NULL && n > 0)
        return 12; /* ENOMEM */
    *out = p;
    return 0;
}
#endif

static long g_ucx_total;

static void count_begin(void)
{
    atomic_store(&g_allocs, 0);
    atomic_store(&g_ucx_allocs, 0);
    atomic_store(&g_counting, g_can_count);
}

/* libkt's allocations since count_begin; UCX's go to g_ucx_total (reported, not failed:
 * UCX 1.13 allocates in its rendezvous and wireup paths now and then). */
static long count_end(void)
{
    atomic_store(&g_counting, 0);
    g_ucx_total += atomic_load(&g_ucx_allocs);
    return atomic_load(&g_allocs);
}

/* x [8, 16] -> matmul w [16, 6] -> cross-entropy against y */
static kt_program *model(void)
{
    kt_graph *g;
    kt_value x, y, w, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){8, 16}, &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){8}, &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, (int64_t[]){16, 6}, kt_init_zeros(), &w));
    OK(kt_graph_op(g, "logits", KT_OP_MATMUL, NULL, (kt_value[]){x, w}, 2, &logits));
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ce.ignore_index = -100;
    OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){logits, y}, 2, &loss));
    OK(kt_graph_set_loss(g, loss));
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

static void scenario_session(kt_comm *comm)
{
    kt_program *p = model();
    kt_session *s;
    kt_session_options so = {.threads = 1, .comm = comm,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 1e-2f}};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y, w;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "w", &w));
    for (int i = 0; i < 8 * 16; i++)
        ((float *)x.data)[i] = (float)((i * 7 + rank_id * 3) % 11) * 0.1f - 0.5f;
    for (int i = 0; i < 8; i++)
        ((int32_t *)y.data)[i] = (i + rank_id) % 6;
    for (int i = 0; i < 16 * 6; i++)
        ((float *)w.data)[i] = (float)(i % 5) * 0.01f;
    float first = 0;
    long worst = 0;
    for (int it = 0; it < 8; it++) {
        if (it >= 3)
            count_begin();
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
        long n = it >= 3 ? count_end() : 0;
        worst = n > worst ? n : worst;
        if (n > 0)
            rank_fail("training step %d (forward, backward, step with the gradient all-reduce) "
                 "allocated %ld times", it, n);
        if (it == 0)
            first = kt_session_loss(s);
    }
    /* it trained: the loss (averaged over the ranks) went down */
    if (!(kt_session_loss(s) < first))
        rank_fail("the loss did not fall: %g then %g", first, kt_session_loss(s));
    printf("ok: 5 steady-state training steps, %ld allocations\n", worst);
    kt_session_destroy(s);
    kt_program_destroy(p);
}

/* Runs op 3 times (warm-up: UCX's pools and registration cache fill), then counts 3 more
 * calls and fails on any allocation. */
#define STEADY(name, expr)                                                                    \
    do {                                                                                      \
        kt_status w_ = (expr), s_ = w_;                                                       \
        for (int k_ = 0; k_ < 2 && s_ == w_; k_++)                                            \
            s_ = (expr);                                                                      \
        count_begin();                                                                        \
        for (int k_ = 0; k_ < 3 && s_ == w_; k_++)                                            \
            s_ = (expr);                                                                      \
        long n_ = count_end();                                                                \
        if (w_ != s_)                                                                         \
            rank_fail("%s: %s then %s: %s", name, kt_status_str(w_), kt_status_str(s_),            \
                 kt_last_error());                                                            \
        if (n_ != 0)                                                                          \
            rank_fail("%s allocated %ld times after its warm-up", name, n_);                       \
        printf("ok: %s: 0 allocations\n", name);                                              \
    } while (0)

static void scenario_collectives(kt_comm *c)
{
    int w = kt_comm_size(c);
    size_t big = 1 << 20; /* elements: 4 MiB of f32, the ring */
    float *a = calloc(big * (size_t)w, sizeof *a), *b = calloc(big * (size_t)w, sizeof *b);
    size_t sb[64], rb[64];
    if (a == NULL || b == NULL || w > 64)
        rank_fail("out of memory");
    for (int p = 0; p < w; p++)
        sb[p] = rb[p] = 4096; /* equal both ways: every pair agrees */
    /* Warm-up of the whole run: UCX finishes connecting the lanes of each endpoint in the
     * background after the first messages (wireup). */
    for (int k = 0; k < 3; k++) {
        OK(kt_comm_all_to_all_v(c, a, sb, b, rb));
        OK(kt_comm_all_reduce(c, a, big, KT_F32, KT_REDUCE_SUM));
        OK(kt_comm_all_reduce(c, a, 100, KT_BF16, KT_REDUCE_SUM));
        nanosleep(&(struct timespec){0, 200 * 1000000L}, NULL);
    }
    STEADY("all_reduce f32 small", kt_comm_all_reduce(c, a, 100, KT_F32, KT_REDUCE_SUM));
    STEADY("all_reduce bf16 small", kt_comm_all_reduce(c, a, 100, KT_BF16, KT_REDUCE_MEAN));
    STEADY("all_reduce f32 ring", kt_comm_all_reduce(c, a, big, KT_F32, KT_REDUCE_SUM));
    STEADY("all_reduce bf16 ring", kt_comm_all_reduce(c, a, big, KT_BF16, KT_REDUCE_MEAN));
    STEADY("reduce_scatter f32", kt_comm_reduce_scatter(c, a, b, big, KT_F32, KT_REDUCE_SUM));
    STEADY("reduce_scatter bf16",
           kt_comm_reduce_scatter(c, a, b, big, KT_BF16, KT_REDUCE_MEAN));
    STEADY("all_gather", kt_comm_all_gather(c, a, big * sizeof(float), b));
    STEADY("all_to_all_v", kt_comm_all_to_all_v(c, a, sb, b, rb));
    STEADY("broadcast", kt_comm_broadcast(c, a, 4096, 0));
    STEADY("barrier", kt_comm_barrier(c));
    STEADY("agree (all well)", kt_comm_agree(c, KT_OK));
    STEADY("agree (rank 1 fails)",
           kt_comm_agree(c, kt_comm_rank(c) == 1 ? KT_EIO : KT_OK));
    free(a);
    free(b);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *r = getenv("KT_RANK");
    rank_id = r != NULL ? atoi(r) : -1;
    if (argc < 2)
        rank_fail("usage: alloc_rank_test session|collectives (under kt-launch)");
    kt_comm *c = NULL;
    OK(kt_comm_create_ucx(NULL, &c));
    if (strcmp(argv[1], "session") == 0)
        scenario_session(c);
    else if (strcmp(argv[1], "collectives") == 0)
        scenario_collectives(c);
    else
        rank_fail("unknown scenario %s", argv[1]);
    if (g_can_count)
        printf("PASS rank %d %s (UCX itself allocated %ld times in the counted calls)\n",
               rank_id, argv[1], g_ucx_total);
    else
        printf("PASS rank %d %s (uncounted: AddressSanitizer owns malloc)\n", rank_id, argv[1]);
    kt_comm_destroy(c);
    return 0;
}
