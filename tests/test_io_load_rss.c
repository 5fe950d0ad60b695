/* Loading N bytes of parameters costs about N bytes of memory, not 2N: kt_session_load copies
 * each tensor out of the mapped checkpoint and gives the mapping's pages back.
 *
 * A child process writes a 64 MiB checkpoint in two shards (so the writer's buffers never
 * count against this process); the test then creates a session of a program with those
 * parameters and loads it, and checks the growth of the peak RSS (VmHWM) over the RSS before
 * the session: at most 1.1x the parameter bytes. The same from a bf16 checkpoint into the f32
 * parameters. As a check that the measurement sees mapped pages at all, copying the tensors
 * from views (which keeps the pages) must show about 2x. Skipped where /proc is absent. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kt/io.h"
#include "kt/kt.h"
#include "tests/support/test_util.h"

enum { N_PARAMS = 32, ROWS = 512, COLS = 1024 };
#define PARAM_BYTES ((double)N_PARAMS * ROWS * COLS * sizeof(float))

/* A /proc/self/status field in kB, or -1. */
static long status_kb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (f == NULL)
        return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f) != NULL)
        if (strncmp(line, key, n) == 0 && line[n] == ':')
            v = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return v;
}

/* Resets VmHWM to the current RSS (Linux 4.0+); 0 when it could. */
static int reset_peak(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f == NULL)
        return -1;
    int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static float value(int param, int64_t i) { return (float)(param * 1000 + (int)(i % 997)) / 64.0f; }

/* In a child: the checkpoint, params 0..15 in the first shard, 16..31 in the second. */
static void write_checkpoint(const char *dir, kt_dtype dtype)
{
    fflush(NULL);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        static char names[N_PARAMS][16];
        kt_st_item items[N_PARAMS];
        for (int k = 0; k < N_PARAMS; k++) {
            snprintf(names[k], sizeof names[k], "w%d", k);
            kt_tensor t;
            kt_tensor_init(&t, NULL, dtype, 2, (int64_t[]){ROWS, COLS});
            t.data = malloc(kt_tensor_nbytes(&t));
            if (t.data == NULL)
                _exit(1);
            for (int64_t i = 0; i < (int64_t)ROWS * COLS; i++) {
                if (dtype == KT_F32)
                    ((float *)t.data)[i] = value(k, i);
                else
                    ((uint16_t *)t.data)[i] = kt_f32_to_bf16_1(value(k, i));
            }
            items[k] = (kt_st_item){names[k], t};
        }
        char path[512], index[4096];
        size_t len = (size_t)snprintf(index, sizeof index, "{\"weight_map\": {");
        for (int k = 0; k < N_PARAMS; k++)
            len += (size_t)snprintf(index + len, sizeof index - len,
                                    "%s\"w%d\": \"part-%d.safetensors\"", k ? ", " : "", k,
                                    k < N_PARAMS / 2 ? 1 : 2);
        snprintf(index + len, sizeof index - len, "}}\n");
        int bad = 0;
        for (int s = 0; s < 2; s++) {
            snprintf(path, sizeof path, "%s/part-%d.safetensors", dir, s + 1);
            bad |= kt_st_save(path, items + s * N_PARAMS / 2, N_PARAMS / 2, NULL) != KT_OK;
        }
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        FILE *f = fopen(path, "w");
        bad |= f == NULL || fputs(index, f) < 0 || fclose(f) != 0;
        _exit(bad);
    }
    int st = 0;
    assert_int_equal(waitpid(child, &st, 0), child);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static kt_session *make_session(kt_program **p_out)
{
    char text[8192];
    size_t len = (size_t)snprintf(text, sizeof text, "input x: f32[1, %d]\n", ROWS);
    for (int k = 0; k < N_PARAMS; k++)
        len += (size_t)snprintf(text + len, sizeof text - len,
                                "param w%d: f32[%d, %d] = zeros\nt%d = matmul(x, w%d)\n", k, ROWS,
                                COLS, k, k);
    len += (size_t)snprintf(text + len, sizeof text - len, "y = t0\n");
    for (int k = 1; k < N_PARAMS; k++)
        len += (size_t)snprintf(text + len, sizeof text - len, "y = add(y, t%d)\n", k);
    len += (size_t)snprintf(text + len, sizeof text - len, "output y\n");
    assert_true(len < sizeof text);
    kt_program *p = tu_compile_ktg(text, "rss.ktg", 0);
    kt_session *s = NULL;
    kt_session_options so = {.threads = 1};
    OK(kt_session_create(p, &so, &s));
    *p_out = p;
    return s;
}

static void spot_check(kt_session *s, kt_dtype stored)
{
    for (int k = 0; k < N_PARAMS; k += 7) {
        char name[16];
        snprintf(name, sizeof name, "w%d", k);
        kt_tensor t;
        OK(kt_session_tensor(s, KT_ROLE_PARAM, name, &t));
        for (int64_t i = 0; i < (int64_t)ROWS * COLS; i += 4099) {
            float want = value(k, i);
            if (stored == KT_BF16)
                want = kt_bf16_to_f32_1(kt_f32_to_bf16_1(want));
            assert_true(((const float *)t.data)[i] == want);
        }
    }
}

/* Loads dir into a new session; returns the peak RSS growth over the RSS before the session
 * was created, in bytes. */
static double load_growth(const char *dir, kt_dtype stored)
{
    kt_program *p;
    int reset = reset_peak();
    long before = status_kb("VmRSS");
    kt_session *s = make_session(&p);
    OK(kt_session_load(s, dir, 0));
    long peak = status_kb("VmHWM");
    assert_true(before > 0 && peak > 0);
    spot_check(s, stored);
    double growth = (double)(peak - before) * 1024.0;
    printf("load of %.1f MB of f32 parameters from %s (2 shards): peak RSS grew %.1f MB "
           "(%.3fx)%s\n", PARAM_BYTES / 1e6, stored == KT_F32 ? "f32" : "bf16", growth / 1e6,
           growth / PARAM_BYTES, reset == 0 ? "" : " (VmHWM could not be reset)");

    /* the counterfactual: the same copies from views, whose pages stay resident */
    if (stored == KT_F32 && reset_peak() == 0) {
        long before2 = status_kb("VmRSS");
        kt_st_file *f;
        OK(kt_st_open(dir, &f));
        for (int k = 0; k < N_PARAMS; k++) {
            char name[16];
            snprintf(name, sizeof name, "w%d", k);
            kt_tensor view, t;
            OK(kt_st_find(f, name, &view));
            OK(kt_session_tensor(s, KT_ROLE_PARAM, name, &t));
            memcpy(t.data, view.data, kt_tensor_nbytes(&t));
        }
        long peak2 = status_kb("VmHWM");
        kt_st_close(f);
        double kept = (double)(peak2 - before2) * 1024.0;
        printf("copying from views instead (the mapping's pages kept): +%.1f MB over the "
               "loaded session (%.3fx of the parameters)\n", kept / 1e6, kept / PARAM_BYTES);
        /* the measurement sees mapped pages: without giving them back a load costs 2x */
        assert_true(kept > 0.9 * PARAM_BYTES);
    }
    kt_session_destroy(s);
    kt_program_destroy(p);
    return growth;
}

static void test_load_rss(void **state)
{
    (void)state;
    if (status_kb("VmHWM") < 0) {
        printf("skipped: no /proc/self/status (VmHWM) on this system\n");
        skip();
    }
    char tmpl[] = "/tmp/kt_rss_test.XXXXXX";
    char *dir = mkdtemp(tmpl);
    assert_non_null(dir);
    const kt_dtype stored[2] = {KT_F32, KT_BF16};
    for (int k = 0; k < 2; k++) {
        write_checkpoint(dir, stored[k]);
        double growth = load_growth(dir, stored[k]);
        assert_true(growth <= 1.1 * PARAM_BYTES);
        assert_true(growth >= 0.9 * PARAM_BYTES); /* the parameters themselves are resident */
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_load_rss)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
