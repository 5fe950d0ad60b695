/* kt-bench graph: the executor's overhead per step.
 *
 * A chain of N scale ops on a tiny tensor is compiled and run by a session; the same N
 * kernel calls are then made directly through the op table with prepared arguments (what
 * the executor does, minus the executor). The difference per step is the overhead. The
 * public, validating kt_op_forward is timed too, to show what the up-front checks save. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "tools/common/usage.h"
#include "lib/ops/op_desc.h"

static int fail(const char *what)
{
    fprintf(stderr, "kt-bench graph: %s: %s\n", what, kt_last_error());
    return 1;
}

int bench_graph(int argc, char **argv, const bench_args *common)
{
    int n_ops = 2000;
    int64_t numel = 16;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench graph [--ops N] [--numel N] [--json] [--repeats N]\n"
                   "Times a session running N tiny scale ops against direct kernel calls;\n"
                   "reports the executor overhead in ns per step (target: under 100).\n");
            return 0;
        } else if (strcmp(argv[i], "--ops") == 0 && i + 1 < argc) {
            long long v;
            if (kt_tool_parse_int("kt-bench graph", "--ops", argv[++i], 1, 1 << 20, &v))
                return 2;
            n_ops = (int)v;
        } else if (strcmp(argv[i], "--numel") == 0 && i + 1 < argc) {
            long long v;
            if (kt_tool_parse_int("kt-bench graph", "--numel", argv[++i], 1, 1ll << 30, &v))
                return 2;
            numel = v;
        } else {
            fprintf(stderr, "kt-bench graph: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    if (n_ops < 1 || numel < 1) {
        fprintf(stderr, "kt-bench graph: --ops and --numel must be positive\n");
        return 2;
    }

    kt_graph *g;
    kt_value v;
    if (kt_graph_create(&g) != KT_OK || kt_graph_input(g, "x", KT_F32, 1, &numel, &v) != KT_OK)
        return fail("build");
    kt_op_attrs attrs = kt_op_defaults(KT_OP_SCALE);
    attrs.alpha = 1.0000001f;
    for (int i = 0; i < n_ops; i++)
        if (kt_graph_op(g, NULL, KT_OP_SCALE, &attrs, &v, 1, &v) != KT_OK)
            return fail("build");
    kt_program *p;
    kt_session *s;
    kt_compile_options co = {.training = 0, .no_cse = 1};
    if (kt_graph_output(g, v, "y") != KT_OK || kt_compile(g, &co, &p) != KT_OK)
        return fail("compile");
    kt_session_options so = {.threads = common->threads};
    if (kt_session_create(p, &so, &s) != KT_OK)
        return fail("session");

    /* the direct side: ping-pong between two buffers, as the plan does */
    float *buf = calloc((size_t)numel * 2, sizeof *buf);
    kt_tensor t[2];
    kt_tensor_init(&t[0], buf, KT_F32, 1, &numel);
    kt_tensor_init(&t[1], buf + numel, KT_F32, 1, &numel);
    kt_threadpool *pool;
    if (buf == NULL || kt_threadpool_create(common->threads, &pool) != KT_OK)
        return fail("setup");
    const kt__op_desc *scale = kt__op_get(KT_OP_SCALE);
    kt__op_call calls[2] = {
        {.attrs = &attrs, .in = &t[0], .n_in = 1, .out = &t[1], .out_w = &t[1], .n_out = 1,
         .pool = pool},
        {.attrs = &attrs, .in = &t[1], .n_in = 1, .out = &t[0], .out_w = &t[0], .n_out = 1,
         .pool = pool}};
    kt_exec ex = {.pool = pool};

    int reps = common->repeats, total = reps + common->warmup;
    double *ts = calloc((size_t)total, sizeof *ts), *td = calloc((size_t)total, sizeof *td);
    double *tc = calloc((size_t)total, sizeof *tc);
    for (int r = 0; r < total; r++) {
        double t0 = bench_now_s();
        if (kt_session_forward(s) != KT_OK)
            return fail("forward");
        double t1 = bench_now_s();
        for (int i = 0; i < n_ops; i++)
            scale->forward(&calls[i & 1]);
        double t2 = bench_now_s();
        for (int i = 0; i < n_ops; i++)
            kt_op_forward(KT_OP_SCALE, &attrs, &t[i & 1], 1, &t[(i + 1) & 1], 1, &ex);
        double t3 = bench_now_s();
        ts[r] = t1 - t0;
        td[r] = t2 - t1;
        tc[r] = t3 - t2;
    }
    double session_ns = bench_median(ts + common->warmup, reps) / n_ops * 1e9;
    double direct_ns = bench_median(td + common->warmup, reps) / n_ops * 1e9;
    double checked_ns = bench_median(tc + common->warmup, reps) / n_ops * 1e9;
    double overhead = session_ns - direct_ns;
    if (common->json)
        printf("{\"bench\":\"graph\",\"config\":{\"ops\":%d,\"numel\":%lld,\"threads\":%d},"
               "\"session_ns_per_step\":%.2f,\"direct_ns_per_step\":%.2f,"
               "\"overhead_ns_per_step\":%.2f,\"checked_call_ns_per_step\":%.2f,"
               "\"ratio_vs_checked_call\":%.3f,\"target_overhead_ns\":100}\n",
               n_ops, (long long)numel, common->threads, session_ns, direct_ns, overhead,
               checked_ns, checked_ns / session_ns);
    else
        printf("graph: %d scale ops on %lld floats, %d thread(s), median of %d\n"
               "  session step      %8.1f ns\n"
               "  direct kernel     %8.1f ns\n"
               "  overhead          %8.1f ns per step (target < 100)\n"
               "  kt_op_forward     %8.1f ns (validating every call; session is %.2fx faster)\n",
               n_ops, (long long)numel, common->threads, reps, session_ns, direct_ns, overhead,
               checked_ns, checked_ns / session_ns);
    free(ts), free(td), free(tc), free(buf);
    kt_threadpool_destroy(pool);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return 0;
}
