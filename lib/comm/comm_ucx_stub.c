/* kt_comm_create_ucx in a build without UCX (the embedded build): the API stays the same,
 * the call says why it cannot work. */
#include "lib/comm/comm_internal.h"
#include "lib/core/error.h"

kt_status kt_comm_create_ucx(const kt_comm_options *options, kt_comm **comm_out)
{
    if (comm_out != NULL)
        *comm_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    (void)options;
    return kt__error(KT_EUNSUPPORTED,
                     "kt_comm_create_ucx: this libkt was built without UCX (KT_WITH_UCX=OFF)");
}
