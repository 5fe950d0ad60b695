/* The environment a local rank reads to join the others (the UCX communicator's bootstrap):
 * shared by kt-launch and kt-bench's multi-rank benchmarks, which start ranks the same way. */
#ifndef KT_TOOLS_RANK_ENV_H
#define KT_TOOLS_RANK_ENV_H

/* In the forked child: KT_RANK, KT_WORLD_SIZE, KT_MASTER_ADDR=127.0.0.1, KT_MASTER_PORT, and
 * KT_JOB_ID / KT_COMM_TRANSPORT when given (NULL leaves them as they are). */
void kt_tool_set_rank_env(int rank, int world, int port, const char *job_id,
                          const char *transport);

#endif
