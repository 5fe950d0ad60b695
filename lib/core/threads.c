/* The thread pool: a fixed set of workers and a statically partitioned parallel-for.
 *
 * Part t of a range always goes to thread t (the caller is thread 0), so a kernel that
 * reduces within parts in a fixed order gives the same bits on every run with the same
 * thread count. Workers spin briefly after a job (kernels come in quick succession during a
 * step) and then sleep on a condition variable.
 */
#define _GNU_SOURCE /* pthread_setaffinity_np, cpu_set_t */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "lib/core/env.h"
#include "lib/core/error.h"
#include "lib/core/numa_internal.h"
#include "lib/core/thread_internal.h"
#include "kt/runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KT__PAUSE() _mm_pause()
#else
#define KT__PAUSE() ((void)0)
#endif

#define KT__SPIN_ITERS 20000
/* Spinners yield the CPU this often: with more threads than free cores, a thread that spins
 * out its whole budget keeps the one it waits for off the CPU, and each job then costs a
 * scheduler time slice (about 1 ms) instead of microseconds. */
#define KT__SPIN_YIELD_MASK 63
#define KT__MAX_NODES 64

typedef struct worker_arg {
    struct kt_threadpool *pool;
    int id;
} worker_arg;

struct kt_threadpool {
    int n_threads;
    int *node; /* [n_threads]: the node of each thread (kt_threadpool_create_numa), or NULL */
    pthread_mutex_t submit_mu; /* held for a whole kt_parallel_for: jobs never interleave */
    pthread_t *workers;
    /* each worker's start argument, owned by the pool: a worker freeing its own would free
     * after kt_threadpool_create returned, whenever it got to run (a test counting the heap
     * calls of a training step saw that free now and then) */
    worker_arg *args;
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t done;
    /* the current job, published by the generation counter */
    kt_range_fn fn;
    void *ctx;
    int64_t n;
    int parts;
    atomic_uint_fast64_t generation;
    atomic_int pending;
    atomic_int stop;
};

/* Where part `part` of [0, n) in `parts` near-equal pieces starts: floor(n * part / parts),
 * computed as q * part + r * part / parts (n = q * parts + r), since n * part itself may pass
 * INT64_MAX (a part would wrap to an empty range and its work be lost); no 128-bit integers,
 * which 32-bit targets lack. */
static int64_t part_start(int64_t n, int part, int parts)
{
    return n / parts * part + n % parts * part / parts;
}

static void run_part(kt_threadpool *p, int part)
{
    int64_t begin = part_start(p->n, part, p->parts);
    int64_t end = part_start(p->n, part + 1, p->parts);
    if (begin < end)
        p->fn(p->ctx, begin, end, part);
}

static uint_fast64_t wait_for_generation(kt_threadpool *p, uint_fast64_t seen)
{
    for (int i = 0; i < KT__SPIN_ITERS; i++) {
        uint_fast64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen || atomic_load(&p->stop))
            return g;
        KT__PAUSE();
        if ((i & KT__SPIN_YIELD_MASK) == KT__SPIN_YIELD_MASK)
            sched_yield();
    }
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->wake, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return atomic_load_explicit(&p->generation, memory_order_acquire);
}

static void *worker_main(void *arg)
{
    const worker_arg *wa = arg;
    kt_threadpool *p = wa->pool;
    const int id = wa->id;
    uint_fast64_t seen = 0;
    for (;;) {
        seen = wait_for_generation(p, seen);
        if (atomic_load(&p->stop))
            break;
        /* Every worker acknowledges every job, even one it has no part in, so the next job
         * cannot be published while a worker still reads this one's fields. */
        if (id < p->parts)
            run_part(p, id);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

static kt_status default_thread_count(int *n_out)
{
    long long v = 0;
    int found;
    KT__TRY(kt__env_int("KT_NUM_THREADS", 1, KT_MAX_THREADS, "a thread count", &v, &found));
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    *n_out = found ? (int)v : cpus > 0 ? (int)(cpus > KT_MAX_THREADS ? KT_MAX_THREADS : cpus) : 1;
    return KT_OK;
}

int kt__thread_start(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc != 0)
        return rc;
    rc = pthread_attr_setstacksize(&attr, KT__THREAD_STACK_BYTES);
    if (rc == 0)
        rc = pthread_create(thread, &attr, fn, arg);
    pthread_attr_destroy(&attr);
    return rc;
}

kt_status kt_threadpool_create(int n_threads, kt_threadpool **pool_out)
{
    if (pool_out != NULL)
        *pool_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (pool_out == NULL)
        return kt__error(KT_EINVAL, "kt_threadpool_create: pool_out is NULL");
    if (n_threads > KT_MAX_THREADS)
        return kt__error(KT_EINVAL, "kt_threadpool_create: %d threads requested, at most %d",
                         n_threads, KT_MAX_THREADS);
    if (n_threads <= 0)
        KT__TRY(default_thread_count(&n_threads));
    kt_threadpool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return kt__error(KT_ENOMEM, "kt_threadpool_create: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->submit_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->stop, 0);
    kt_status status = KT_OK;
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        p->args = calloc((size_t)n_threads - 1, sizeof *p->args);
        if (p->workers == NULL || p->args == NULL) {
            status = kt__error(KT_ENOMEM, "kt_threadpool_create: out of memory");
            goto err_destroy;
        }
        for (int i = 1; i < n_threads; i++) {
            worker_arg *wa = &p->args[i - 1];
            wa->pool = p;
            wa->id = i;
            if (kt__thread_start(&p->workers[i - 1], worker_main, wa) != 0) {
                status = kt__error(KT_ENOMEM, "kt_threadpool_create: cannot start thread %d of "
                                   "%d", i, n_threads);
                goto err_destroy;
            }
            p->n_started++;
        }
    }
    *pool_out = p;
    return KT_OK;

err_destroy:
    kt_threadpool_destroy(p);
    return status;
}

void kt_threadpool_destroy(kt_threadpool *pool)
{
    if (pool == NULL)
        return;
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++)
        pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    free(pool->args);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->submit_mu);
    free(pool->node);
    free(pool);
}

int kt_threadpool_size(const kt_threadpool *pool) { return pool ? pool->n_threads : 1; }

/* A job of `parts` > 1 parts over the pool's threads, the caller's as thread 0. */
static void run_job(kt_threadpool *pool, int parts, int64_t n, kt_range_fn fn, void *ctx)
{
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->parts = parts;
    atomic_store_explicit(&pool->pending, pool->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool->mu);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);

    run_part(pool, 0);

    for (int i = 0; i < KT__SPIN_ITERS; i++) {
        if (atomic_load_explicit(&pool->pending, memory_order_acquire) == 0)
            return;
        KT__PAUSE();
        if ((i & KT__SPIN_YIELD_MASK) == KT__SPIN_YIELD_MASK)
            sched_yield();
    }
    pthread_mutex_lock(&pool->mu);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0)
        pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}

void kt_parallel_for(kt_threadpool *pool, int64_t n, int64_t grain, kt_range_fn fn, void *ctx)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    /* Rounded down, so every part gets at least `grain` items as documented. */
    const int64_t max_parts = n / grain;
    int parts = kt_threadpool_size(pool);
    if (max_parts < parts)
        parts = (int)max_parts;
    if (parts <= 1) { /* the caller alone: the pool's threads and state are not involved */
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&pool->submit_mu);
    run_job(pool, parts, n, fn, ctx);
    pthread_mutex_unlock(&pool->submit_mu);
}

int kt_threadpool_thread_node(const kt_threadpool *pool, int thread)
{
    if (pool == NULL || pool->node == NULL || thread < 0 || thread >= pool->n_threads)
        return -1;
    return pool->node[thread];
}

kt_status kt_threadpool_create_numa(int n_threads, kt_threadpool **pool_out)
{
    if (pool_out != NULL)
        *pool_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    KT__TRY(kt_threadpool_create(n_threads, pool_out));
    kt_threadpool *p = *pool_out;
    p->node = calloc((size_t)p->n_threads, sizeof *p->node);
    if (p->node == NULL) {
        kt_threadpool_destroy(p);
        *pool_out = NULL;
        return kt__error(KT_ENOMEM, "kt_threadpool_create_numa: out of memory");
    }
#ifdef __linux__
    /* The nodes this process may run on: those with CPUs inside its affinity mask (a
     * cpuset or taskset is respected; memory-only nodes get no threads). */
    cpu_set_t allowed, sets[KT__MAX_NODES];
    int usable[KT__MAX_NODES], n_usable = 0;
    const int nodes = kt_numa_node_count();
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        CPU_ZERO(&allowed);
    for (int n = 0; nodes > 1 && n < nodes && n < KT__MAX_NODES; n++) {
        cpu_set_t set;
        if (kt__numa_node_cpus(n, &set) != KT_OK)
            continue;
        CPU_AND(&sets[n_usable], &set, &allowed);
        if (CPU_COUNT(&sets[n_usable]) > 0)
            usable[n_usable++] = n;
    }
    for (int t = 0; t < p->n_threads; t++) {
        const int u = (int)((int64_t)t * (n_usable ? n_usable : 1) / p->n_threads);
        p->node[t] = n_usable ? usable[u] : 0;
        /* thread 0 is the caller's thread, left where it is */
        if (t > 0 && n_usable > 1 &&
            pthread_setaffinity_np(p->workers[t - 1], sizeof sets[u], &sets[u]) != 0) {
            kt_threadpool_destroy(p);
            *pool_out = NULL;
            return kt__error(KT_EINVAL, "kt_threadpool_create_numa: cannot pin thread %d to "
                             "the CPUs of node %d", t, usable[u]);
        }
    }
#endif
    return KT_OK;
}
