/* kt-bench: shared helpers for the benchmark subcommands. */
#ifndef KT_TOOLS_BENCH_H
#define KT_TOOLS_BENCH_H

#include <stdint.h>
#include <stdio.h>

typedef struct bench_args {
    int json;       /* one JSON object per configuration instead of text */
    int repeats;    /* timed repetitions (median reported) */
    int warmup;
    int threads;
    int threads_given, repeats_given; /* set on the command line (else each bench's default) */
} bench_args;

double bench_now_s(void);
/* Median of n values (sorts them). */
double bench_median(double *v, int n);

/* Subcommands: parse their own options from argv (after the subcommand name). */
int bench_graph(int argc, char **argv, const bench_args *common);
int bench_gemm(int argc, char **argv, const bench_args *common);
int bench_moe(int argc, char **argv, const bench_args *common);
int bench_checkpoint(int argc, char **argv, const bench_args *common);

#endif
