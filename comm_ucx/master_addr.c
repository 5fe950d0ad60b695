/* Where rank 0 listens when no address is given (KT_MASTER_ADDR, MASTER_ADDR, the options).
 *
 * A site launcher that places ranks on several hosts does not say so in the variables that
 * give the rank: under Slurm rank 0 runs on the first host of the step's node list (block
 * and cyclic distributions alike), which is taken from SLURM_STEP_NODELIST (else
 * SLURM_JOB_NODELIST, SLURM_NODELIST), compressed as Slurm writes it ("node[03-05,9],gpu1":
 * node03). mpirun has no variable with rank 0's host: the job must give KT_MASTER_ADDR
 * unless every rank is on this host (OMPI_COMM_WORLD_LOCAL_SIZE equals the world). Falling
 * back to 127.0.0.1 then would make every rank wait for a master on its own host. Ranks
 * from kt-launch and torchrun always come with an address; one started by hand without it
 * is taken to be on this host, as before. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_ucx/ucx_internal.h"
#include "lib/core/error.h"

/* The first host of a Slurm host list, or 0 when it is not one. */
static int first_host(const char *list, char out[256])
{
    size_t o = 0;
    for (size_t i = 0; list[i] != '\0' && list[i] != ','; ) {
        if (o + 1 >= 256)
            return 0;
        if (list[i] != '[') {
            out[o++] = list[i++];
            continue;
        }
        i++; /* a range or a list of numbers: its first number, as written (zero padded) */
        if (!isdigit((unsigned char)list[i]))
            return 0;
        while (isdigit((unsigned char)list[i]) && o + 1 < 256)
            out[o++] = list[i++];
        while (list[i] != '\0' && list[i] != ']')
            i++;
        if (list[i] != ']')
            return 0;
        i++;
    }
    out[o] = '\0';
    return o > 0;
}

static int env_equals_int(const char *name, long v)
{
    const char *s = getenv(name);
    char *end;
    return s != NULL && s[0] != '\0' && strtol(s, &end, 10) == v && *end == '\0';
}

kt_status kt__ucx_default_master(const char *source, int size, char out[256])
{
    if (strcmp(source, "SLURM_PROCID") == 0) {
        static const char *const lists[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                            "SLURM_NODELIST"};
        for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
            const char *v = getenv(lists[i]);
            if (v == NULL || v[0] == '\0')
                continue;
            if (!first_host(v, out))
                return kt__error(KT_EINVAL, "kt_comm_create_ucx: %s=%.100s is not a Slurm host "
                                 "list; set KT_MASTER_ADDR to rank 0's host", lists[i], v);
            return KT_OK;
        }
        if (env_equals_int("SLURM_STEP_NUM_NODES", 1) || env_equals_int("SLURM_NNODES", 1))
            goto local;
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: a Slurm job of %d ranks with no node list "
                         "(SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) to find rank 0's host: set "
                         "KT_MASTER_ADDR", size);
    }
    if (strcmp(source, "OMPI_COMM_WORLD_RANK") == 0) {
        if (env_equals_int("OMPI_COMM_WORLD_LOCAL_SIZE", size))
            goto local;
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: mpirun started %d ranks%s, and its "
                         "variables do not say where rank 0 runs: give every rank "
                         "KT_MASTER_ADDR=<rank 0's host> (mpirun -x KT_MASTER_ADDR=...)", size,
                         getenv("OMPI_COMM_WORLD_LOCAL_SIZE") != NULL
                             ? " on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE)"
                             : "");
    }
local:
    snprintf(out, 256, "127.0.0.1");
    return KT_OK;
}
