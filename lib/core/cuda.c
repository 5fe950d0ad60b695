/* The CUDA runtime, when libkt is built with it. A machine without a GPU (or without a
 * driver) has zero devices; that is not an error. */
#include "kt/runtime.h"

#ifdef KT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

int kt_cuda_device_count(void)
{
#ifdef KT_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
#else
    return 0;
#endif
}
