/* The number of CUDA devices. libkt's CUDA path only counts devices today, so it asks the
 * driver (libcuda.so.1, loaded at run time) instead of linking the CUDA runtime: a program
 * linked against libkt needs no CUDA toolkit, and a machine without a GPU or a driver has
 * zero devices, which is not an error. */
#include "kt/runtime.h"

#ifdef KT_HAVE_CUDA
#include <dlfcn.h>

typedef int (*cu_init_fn)(unsigned flags);
typedef int (*cu_device_count_fn)(int *count);
#endif

int kt_cuda_device_count(void)
{
#ifdef KT_HAVE_CUDA
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver == NULL)
        return 0;
    cu_init_fn init;
    cu_device_count_fn device_count;
    /* POSIX's way to turn dlsym's object pointer into a function pointer */
    *(void **)&init = dlsym(driver, "cuInit");
    *(void **)&device_count = dlsym(driver, "cuDeviceGetCount");
    int n = 0;
    if (init == NULL || device_count == NULL || init(0) != 0 || device_count(&n) != 0)
        n = 0;
    dlclose(driver);
    return n;
#else
    return 0;
#endif
}
