/* kt-bench: shared helpers for the benchmark subcommands. */
#ifndef KT_TOOLS_BENCH_H
#define KT_TOOLS_BENCH_H

#include <math.h>
#include <stddef.h>
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
int bench_comm(int argc, char **argv, const bench_args *common);
int bench_halo(int argc, char **argv, const bench_args *common);
int bench_attention(int argc, char **argv, const bench_args *common);
int bench_layer(int argc, char **argv, const bench_args *common);
int bench_train(int argc, char **argv, const bench_args *common);

/* Multi-rank benchmarks (bench_comm.c). kt-bench starts its ranks itself: fork + exec of its
 * own binary as "kt-bench __rank ARGS..." with the rank environment (KT_RANK, KT_WORLD_SIZE,
 * KT_MASTER_ADDR, KT_MASTER_PORT, KT_COMM_TRANSPORT). Rank 0 writes text lines to the stream
 * bench_result_stream() gives it; the parent hands each line to on_line. Returns 0 when every
 * rank exited 0. */
typedef void (*bench_line_fn)(void *ctx, const char *line);
int bench_spawn_ranks(int n, const char *transport, char *const *args, int n_args,
                      bench_line_fn on_line, void *ctx);
int bench_rank(int argc, char **argv);               /* the "__rank" entry */
int bench_halo_rank(int argc, char **argv);          /* bench_halo.c */
int bench_coll_rank(int argc, char **argv);          /* bench_coll.c */
/* kt-bench comm --collectives (bench_coll.c) */
int bench_coll(int argc, char **argv, const bench_args *common);
/* ucx_perftest tag_bw at bytes over the transport (MB/s), < 0 with a note when it cannot */
double bench_ucx_perftest_bw(size_t bytes, const char *transport, char *note, size_t note_size);
int bench_moe_rank(int argc, char **argv);           /* bench_moe_ranks.c */
/* kt-bench moe --ranks: rank 0 holding the experts against expert parallelism */
int bench_moe_ranks(int argc, char **argv, const bench_args *common);
FILE *bench_result_stream(void);                     /* rank 0: NULL elsewhere */
struct kt_comm *bench_rank_comm(const char *who);    /* the UCX communicator from the env */
int bench_have_ucx(void);
int bench_cpu(int idx); /* the idx-th usable CPU (mod their count), -1 if unknown */
int bench_no_ucx(const char *bench, int json);       /* the no-UCX line; returns 0 */
const char *bench_comm_peer_script(void);
/* "8,64,1k,4M" -> bytes; the count, or -1 on a malformed list */
int bench_parse_sizes(const char *s, size_t *out, int max);
/* A peer script: `built_in` (the source tree's) when it is there, else `name` where it is
 * installed (KT_BENCH_DATADIR, or share/kt beside a relocated bin/; the path in buf), else
 * built_in. */
const char *bench_find_script(const char *built_in, const char *name, char *buf, size_t size);
/* 1 when s is one of names[0, n) (an option that takes a value, say) */
int bench_is_one_of(const char *s, const char *const *names, int n);
/* Runs a peer command; its stdout lines starting with '{' go into buf. 0 + note on failure. */
int bench_run_peer(const char *cmd, char *buf, size_t size, char *note, size_t note_size);
double bench_peer_value(const char *buf, const char *match1, const char *match2,
                        const char *key);
void bench_print_ratio(const char *key, double v, int have);
/* v printed with fmt into buf, or "null" where it is not finite (JSON has no inf or nan: a
 * fraction of a peak that could not be measured, say); BENCH_JNUM gives each use its buffer. */
const char *bench_jnum(char *buf, size_t size, const char *fmt, double v);
#define BENCH_JNUM(fmt, v) bench_jnum((char[48]){0}, 48, fmt, v)
/* num / den, or NAN (printed null) where den is not a positive figure */
static inline double bench_ratio(double num, double den)
{
    return den > 0 ? num / den : (double)NAN;
}
void bench_print_json_text(const char *s);

#endif
