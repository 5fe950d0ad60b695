/* The thread pool: coverage of every index, the static partition (part t always on the
 * same thread, thread 0 the caller), the NULL pool, KT_NUM_THREADS, back-to-back jobs
 * without lost wake-ups, repeated create/destroy, and limits. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

#define MAX_PARTS 64

/* What one kt_parallel_for call did: the parts it ran, with the OS thread of each. */
typedef struct record {
    pthread_mutex_t mu;
    int n_parts;
    int64_t begin[MAX_PARTS], end[MAX_PARTS];
    int thread[MAX_PARTS];
    pthread_t os_thread[MAX_PARTS];
    atomic_int *hits; /* per index */
} record;

static void record_fn(void *ctx, int64_t begin, int64_t end, int thread)
{
    record *r = ctx;
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&r->hits[i], 1);
    pthread_mutex_lock(&r->mu);
    if (r->n_parts < MAX_PARTS) {
        r->begin[r->n_parts] = begin;
        r->end[r->n_parts] = end;
        r->thread[r->n_parts] = thread;
        r->os_thread[r->n_parts] = pthread_self();
    }
    r->n_parts++;
    pthread_mutex_unlock(&r->mu);
}

static void record_init(record *r, int64_t n)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    r->hits = calloc((size_t)(n > 0 ? n : 1), sizeof *r->hits);
    assert_non_null(r->hits);
}

static void record_free(record *r)
{
    free(r->hits);
    pthread_mutex_destroy(&r->mu);
}

/* Checks one call: every index once, parts contiguous and ordered by thread id, thread ids
 * distinct and within the pool, part 0 on the caller, at most size(pool) parts of at least
 * `grain` items each (a single part may be smaller: the range itself is). */
static void check_record(const record *r, int64_t n, int64_t grain, int size)
{
    for (int64_t i = 0; i < n; i++)
        if (r->hits[i] != 1)
            fail_msg("n=%lld grain=%lld threads=%d: index %lld ran %d times", (long long)n,
                     (long long)grain, size, (long long)i, (int)r->hits[i]);
    if (n <= 0) {
        assert_int_equal(r->n_parts, 0);
        return;
    }
    assert_true(r->n_parts >= 1 && r->n_parts <= size);
    int64_t covered = 0;
    for (int t = 0; t < r->n_parts; t++) {
        /* find the part of thread t: parts are numbered 0..parts-1 in index order */
        int k = -1;
        for (int j = 0; j < r->n_parts; j++)
            if (r->thread[j] == t)
                k = j;
        if (k < 0)
            fail_msg("n=%lld grain=%lld threads=%d: no part for thread %d of %d", (long long)n,
                     (long long)grain, size, t, r->n_parts);
        assert_true(r->begin[k] == covered);
        assert_true(r->end[k] > r->begin[k]);
        if (r->n_parts > 1 && r->end[k] - r->begin[k] < grain)
            fail_msg("n=%lld grain=%lld threads=%d: part %d has %lld items, fewer than the "
                     "grain", (long long)n, (long long)grain, size, t,
                     (long long)(r->end[k] - r->begin[k]));
        covered = r->end[k];
        if (t == 0 && !pthread_equal(r->os_thread[k], pthread_self()))
            fail_msg("part 0 did not run on the caller's thread");
    }
    assert_true(covered == n);
}

static void test_coverage(void **state)
{
    (void)state;
    const int sizes[] = {1, 2, 3, 4, 7};
    const int64_t ns[] = {0, 1, 2, 3, 5, 7, 8, 10, 100, 1000, 4097};
    const int64_t grains[] = {-5, 0, 1, 2, 3, 4, 7, 64, 1000, 5000};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        kt_threadpool *pool = NULL;
        assert_int_equal(kt_threadpool_create(sizes[s], &pool), KT_OK);
        assert_int_equal(kt_threadpool_size(pool), sizes[s]);
        for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
            for (size_t g = 0; g < sizeof grains / sizeof grains[0]; g++) {
                record r;
                record_init(&r, ns[a]);
                kt_parallel_for(pool, ns[a], grains[g], record_fn, &r);
                check_record(&r, ns[a], grains[g] < 1 ? 1 : grains[g], sizes[s]);
                /* as many parts as the grain allows, up to the pool's size */
                int64_t by_grain = ns[a] / (grains[g] < 1 ? 1 : grains[g]);
                int64_t want = by_grain < sizes[s] ? by_grain : sizes[s];
                if (ns[a] > 0)
                    assert_int_equal(r.n_parts, want < 1 ? 1 : want);
                record_free(&r);
            }
        }
        kt_threadpool_destroy(pool);
    }
}

/* n < 0 runs nothing. */
static void test_negative_n(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(3, &pool), KT_OK);
    record r;
    record_init(&r, 1);
    kt_parallel_for(pool, -10, 1, record_fn, &r);
    kt_parallel_for(NULL, -10, 1, record_fn, &r);
    assert_int_equal(r.n_parts, 0);
    record_free(&r);
    kt_threadpool_destroy(pool);
}

/* The same range on the same pool: the same parts on the same OS threads, every time. */
static void test_static_partition(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(4, &pool), KT_OK);
    const int64_t n = 1003;
    record first;
    record_init(&first, n);
    kt_parallel_for(pool, n, 10, record_fn, &first);
    check_record(&first, n, 10, 4);
    assert_int_equal(first.n_parts, 4);
    for (int call = 0; call < 50; call++) {
        /* other work in between must not disturb the assignment */
        record other;
        record_init(&other, 37 + call);
        kt_parallel_for(pool, 37 + call, 1 + call % 5, record_fn, &other);
        record_free(&other);

        record r;
        record_init(&r, n);
        kt_parallel_for(pool, n, 10, record_fn, &r);
        check_record(&r, n, 10, 4);
        assert_int_equal(r.n_parts, first.n_parts);
        for (int a = 0; a < r.n_parts; a++) {
            int b = 0;
            while (first.thread[b] != r.thread[a])
                b++;
            assert_true(first.begin[b] == r.begin[a] && first.end[b] == r.end[a]);
            if (!pthread_equal(first.os_thread[b], r.os_thread[a]))
                fail_msg("call %d: part %d ran on a different OS thread", call, r.thread[a]);
        }
        record_free(&r);
    }
    /* the OS threads of different parts are different threads */
    for (int a = 0; a < first.n_parts; a++)
        for (int b = a + 1; b < first.n_parts; b++)
            assert_false(pthread_equal(first.os_thread[a], first.os_thread[b]));
    record_free(&first);
    kt_threadpool_destroy(pool);
}

/* Ranges only (no work): the parts of a huge n cover [0, n) exactly, no part lost to an
 * overflowing n * part (it had wrapped to an empty range). */
typedef struct span_log {
    int64_t begin[8], end[8];
    _Atomic int count;
} span_log;

static void log_span(void *ctx, int64_t begin, int64_t end, int thread)
{
    span_log *l = ctx;
    assert_true(thread >= 0 && thread < 8);
    l->begin[thread] = begin;
    l->end[thread] = end;
    atomic_fetch_add(&l->count, 1);
}

static void test_huge_n(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(3, &pool), KT_OK);
    span_log l;
    memset(&l, 0, sizeof l);
    kt_parallel_for(pool, INT64_MAX, INT64_MAX / 4, log_span, &l);
    const int parts = atomic_load(&l.count);
    assert_int_equal(parts, 3);
    assert_int_equal(l.begin[0], 0);
    for (int t = 1; t < parts; t++)
        assert_int_equal(l.begin[t], l.end[t - 1]);
    assert_int_equal(l.end[parts - 1], INT64_MAX);
    kt_threadpool_destroy(pool);
}

static void test_null_pool(void **state)
{
    (void)state;
    assert_int_equal(kt_threadpool_size(NULL), 1);
    const int64_t ns[] = {0, 1, 1000};
    for (int k = 0; k < 3; k++) {
        record r;
        record_init(&r, ns[k]);
        kt_parallel_for(NULL, ns[k], 1, record_fn, &r);
        check_record(&r, ns[k], 1, 1);
        if (ns[k] > 0) {
            assert_int_equal(r.n_parts, 1);
            assert_int_equal(r.thread[0], 0);
            assert_true(r.begin[0] == 0 && r.end[0] == ns[k]);
        }
        record_free(&r);
    }
    kt_threadpool_destroy(NULL); /* harmless */
}

static int online_cpus(void)
{
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)(c > 1024 ? 1024 : c) : 1;
}

static void expect_default_size(const char *env, int want)
{
    if (env)
        assert_int_equal(setenv("KT_NUM_THREADS", env, 1), 0);
    else
        assert_int_equal(unsetenv("KT_NUM_THREADS"), 0);
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(0, &pool), KT_OK);
    if (kt_threadpool_size(pool) != want)
        fail_msg("KT_NUM_THREADS=%s: pool of %d threads, expected %d", env ? env : "(unset)",
                 kt_threadpool_size(pool), want);
    /* and it works */
    record r;
    record_init(&r, 100);
    kt_parallel_for(pool, 100, 1, record_fn, &r);
    check_record(&r, 100, 1, want);
    record_free(&r);
    kt_threadpool_destroy(pool);
}

static void test_env_thread_count(void **state)
{
    (void)state;
    const char *saved = getenv("KT_NUM_THREADS");
    char *keep = saved ? strdup(saved) : NULL;
    expect_default_size("3", 3);
    expect_default_size("1", 1);
    expect_default_size("5", 5);
    /* a value that is set must be a thread count: anything else is refused, naming it */
    static const char *const bad[] = {"abc", "0", "-4", "3x", "5000", "99999999999", " 2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kt_threadpool *none = NULL;
        assert_int_equal(setenv("KT_NUM_THREADS", bad[i], 1), 0);
        TU_EXPECT_ERROR(kt_threadpool_create(0, &none), KT_EINVAL, "KT_NUM_THREADS", bad[i]);
        assert_null(none);
        TU_EXPECT_ERROR(kt_check_environment(), KT_EINVAL, "KT_NUM_THREADS", "1 to 1024");
    }
    expect_default_size("", online_cpus());
    expect_default_size(NULL, online_cpus());
    /* a negative request also means "the default" */
    assert_int_equal(setenv("KT_NUM_THREADS", "2", 1), 0);
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(-1, &pool), KT_OK);
    assert_int_equal(kt_threadpool_size(pool), 2);
    kt_threadpool_destroy(pool);
    /* an explicit count wins over the environment */
    assert_int_equal(kt_threadpool_create(3, &pool), KT_OK);
    assert_int_equal(kt_threadpool_size(pool), 3);
    kt_threadpool_destroy(pool);
    if (keep) {
        setenv("KT_NUM_THREADS", keep, 1);
        free(keep);
    } else {
        unsetenv("KT_NUM_THREADS");
    }
}

/* Back-to-back jobs: a lost wake-up would hang, a lost or repeated part would break a sum. */
typedef struct sum_job {
    int64_t partial[MAX_PARTS];
} sum_job;

static void sum_fn(void *ctx, int64_t begin, int64_t end, int thread)
{
    sum_job *j = ctx;
    int64_t s = 0;
    for (int64_t i = begin; i < end; i++)
        s += i;
    j->partial[thread] += s;
}

static void stress_pool(kt_threadpool *pool, int threads, int calls)
{
    for (int c = 0; c < calls; c++) {
        int64_t n = 1 + c % 97;
        sum_job j;
        memset(&j, 0, sizeof j);
        kt_parallel_for(pool, n, 1 + c % 3, sum_fn, &j);
        int64_t total = 0;
        for (int t = 0; t < threads; t++)
            total += j.partial[t];
        if (total != n * (n - 1) / 2)
            fail_msg("%d threads, call %d: sum %lld, expected %lld", threads, c,
                     (long long)total, (long long)(n * (n - 1) / 2));
    }
}

static void stress(int threads, int calls)
{
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    stress_pool(pool, threads, calls);
    kt_threadpool_destroy(pool);
}

static void test_stress(void **state)
{
    (void)state;
    stress(2, 20000);
    stress(4, 20000);
}

/* Two threads submitting to one pool at once: the submission lock keeps the jobs apart, so
 * every job still sees each item exactly once. */
typedef struct submitter {
    kt_threadpool *pool;
    int calls;
    int bad;
} submitter;

static void *submit_main(void *arg)
{
    submitter *sb = arg;
    for (int c = 0; c < sb->calls; c++) {
        int64_t n = 1 + c % 89;
        sum_job j;
        memset(&j, 0, sizeof j);
        kt_parallel_for(sb->pool, n, 1, sum_fn, &j);
        int64_t total = 0;
        for (int t = 0; t < MAX_PARTS; t++)
            total += j.partial[t];
        sb->bad += total != n * (n - 1) / 2;
    }
    return NULL;
}

static void test_concurrent_submitters(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(3, &pool), KT_OK);
    submitter sb[2] = {{pool, 5000, 0}, {pool, 5000, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, submit_main, &sb[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(sb[0].bad + sb[1].bad, 0);
    kt_threadpool_destroy(pool);
}

/* Placement: contiguous blocks of threads per node (stand-in nodes here when the machine has
 * fewer), and -1 for ordinary pools. */
static void test_numa_pool(void **state)
{
    (void)state;
    const char *env = getenv("KT_NUMA_FAKE_NODES");
    char *saved = env ? strdup(env) : NULL;
    setenv("KT_NUMA_FAKE_NODES", "2", 1);
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create_numa(5, &pool), KT_OK);
    const int want[5] = {0, 0, 0, 1, 1}; /* t * 2 / 5 */
    for (int t = 0; t < 5; t++)
        assert_int_equal(kt_threadpool_thread_node(pool, t), want[t]);
    assert_int_equal(kt_threadpool_thread_node(pool, 5), -1);
    stress_pool(pool, 5, 2000);
    kt_threadpool_destroy(pool);
    if (saved)
        setenv("KT_NUMA_FAKE_NODES", saved, 1);
    else
        unsetenv("KT_NUMA_FAKE_NODES");
    free(saved);
    assert_int_equal(kt_threadpool_create(2, &pool), KT_OK);
    assert_int_equal(kt_threadpool_thread_node(pool, 0), -1);
    assert_int_equal(kt_threadpool_thread_node(NULL, 0), -1);
    kt_threadpool_destroy(pool);
}

static void test_create_destroy(void **state)
{
    (void)state;
    for (int i = 0; i < 100; i++) {
        int size = 1 + i % 5;
        kt_threadpool *pool = NULL;
        assert_int_equal(kt_threadpool_create(size, &pool), KT_OK);
        assert_int_equal(kt_threadpool_size(pool), size);
        if (i % 2) {
            sum_job j;
            memset(&j, 0, sizeof j);
            kt_parallel_for(pool, 50, 1, sum_fn, &j);
            int64_t total = 0;
            for (int t = 0; t < size; t++)
                total += j.partial[t];
            assert_int_equal(total, 50 * 49 / 2);
        }
        kt_threadpool_destroy(pool);
    }
}

static void test_limits(void **state)
{
    (void)state;
    kt_threadpool *pool = (kt_threadpool *)(uintptr_t)0x1;
    TU_EXPECT_ERROR(kt_threadpool_create(1025, &pool), KT_EINVAL, "1025");
    TU_EXPECT_ERROR(kt_threadpool_create(1 << 30, &pool), KT_EINVAL, "threads");
    assert_null(pool); /* a failed create leaves NULL (SQLite's rule; was: untouched) */
    TU_EXPECT_ERROR(kt_threadpool_create(2, NULL), KT_EINVAL, "kt_threadpool_create");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_coverage),        cmocka_unit_test(test_negative_n),
        cmocka_unit_test(test_static_partition), cmocka_unit_test(test_null_pool),
        cmocka_unit_test(test_huge_n),
        cmocka_unit_test(test_env_thread_count), cmocka_unit_test(test_stress),
        cmocka_unit_test(test_create_destroy),  cmocka_unit_test(test_limits),
        cmocka_unit_test(test_concurrent_submitters), cmocka_unit_test(test_numa_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
