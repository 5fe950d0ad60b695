/* Version and build description. */
#include "kt/kt.h"

unsigned kt_version(void) { return KT_VERSION_HEX; }

const char *kt_version_string(void) { return KT_VERSION_STRING; }

const char *kt_build_features(void)
{
    /* each name carries a leading space; the first one is skipped */
    static const char features[] = ""
#ifdef KT_HAVE_OPENBLAS
                                   " openblas"
#endif
#ifdef KT_HAVE_NUMA
                                   " numa"
#endif
#ifdef KT_HAVE_UCX
                                   " ucx"
#endif
#ifdef KT_HAVE_CUDA
                                   " cuda"
#endif
        ;
    return features[0] ? features + 1 : features;
}
