#include "tools/common/rank_env.h"

#include <stdio.h>
#include <stdlib.h>

void kt_tool_set_rank_env(int rank, int world, int port, const char *job_id,
                          const char *transport)
{
    char v[32];
    snprintf(v, sizeof v, "%d", rank);
    setenv("KT_RANK", v, 1);
    snprintf(v, sizeof v, "%d", world);
    setenv("KT_WORLD_SIZE", v, 1);
    setenv("KT_MASTER_ADDR", "127.0.0.1", 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("KT_MASTER_PORT", v, 1);
    if (job_id != NULL)
        setenv("KT_JOB_ID", job_id, 1);
    if (transport != NULL)
        setenv("KT_COMM_TRANSPORT", transport, 1);
}
