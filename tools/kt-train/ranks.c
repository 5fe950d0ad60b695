/* The ranks of a run. kt-train started by hand is one rank and needs no network; started by
 * a launcher (kt-launch, torchrun, mpirun, srun) it joins the others through the UCX
 * communicator, which reads the same environment. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/train.h"

/* The world size a launcher announced (1 when none did), or -1 after printing why the
 * announced one is not a number. The pairs are the ones the UCX communicator reads
 * (comm_ucx/bootstrap.c), in the same order: a value it would refuse must not make this
 * rank train alone. */
static int env_world_size(void)
{
    static const char *const vars[][2] = {{"KT_RANK", "KT_WORLD_SIZE"},
                                          {"RANK", "WORLD_SIZE"},
                                          {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                          {"SLURM_PROCID", "SLURM_NTASKS"}};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *rank = getenv(vars[i][0]), *size = getenv(vars[i][1]);
        if (rank == NULL || rank[0] == '\0' || size == NULL || size[0] == '\0')
            continue;
        char *end = NULL;
        errno = 0;
        long v = strtol(size, &end, 10);
        if (errno != 0 || *end != '\0' || v < 1 || v > 65536) {
            train_error("%s=%s is not a world size (1 to 65536)", vars[i][1],
                        size);
            return -1;
        }
        /* the communicator checks the rank against a larger world; alone it must be 0 */
        if (v == 1 && strcmp(rank, "0") != 0) {
            train_error("%s=%s with %s=1: a world of one rank is rank 0", vars[i][0], rank,
                        vars[i][1]);
            return -1;
        }
        return (int)v;
    }
    return 1;
}

int ranks_open(ranks *r)
{
    r->comm = NULL;
    r->rank = 0;
    r->world = 1;
    const int world = env_world_size();
    if (world < 0)
        return 1;
    if (world == 1)
        return 0;
    if (kt_comm_create_ucx(NULL, &r->comm) != KT_OK) {
        r->comm = NULL;
        return train_fail("cannot join the other ranks", kt_last_error());
    }
    r->rank = kt_comm_rank(r->comm);
    r->world = kt_comm_size(r->comm);
    return 0;
}

void ranks_close(ranks *r)
{
    kt_comm_destroy(r->comm);
    r->comm = NULL;
}

kt_status ranks_agree(const ranks *r, kt_status local)
{
    return r->comm != NULL ? kt_comm_agree(r->comm, local) : local;
}
