/* The ranks of a run. kt-train started by hand is one rank and needs no network; started by
 * a launcher (kt-launch, torchrun, mpirun, srun) it joins the others through the UCX
 * communicator, which reads the same environment. */
#include <stdlib.h>

#include "train.h"

/* The world size a launcher announced, or 1. The pairs are the ones the UCX communicator
 * reads (comm_ucx/bootstrap.c), in the same order. */
static int env_world_size(void)
{
    static const char *const vars[][2] = {{"KT_RANK", "KT_WORLD_SIZE"},
                                          {"RANK", "WORLD_SIZE"},
                                          {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                          {"SLURM_PROCID", "SLURM_NTASKS"}};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *rank = getenv(vars[i][0]), *size = getenv(vars[i][1]);
        if (rank != NULL && rank[0] != '\0' && size != NULL && size[0] != '\0')
            return atoi(size) > 1 ? atoi(size) : 1;
    }
    return 1;
}

int ranks_open(ranks *r)
{
    r->comm = NULL;
    r->rank = 0;
    r->world = 1;
    if (env_world_size() <= 1)
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
