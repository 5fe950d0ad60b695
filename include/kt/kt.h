/* libkt: training Mixture-of-Experts and context-parallel models from plain C.
 * The umbrella header; include this one. */
#ifndef KT_KT_H
#define KT_KT_H

/* The build reads these three lines to set the project version: keep their form. */
#define KT_VERSION_MAJOR 0
#define KT_VERSION_MINOR 1
#define KT_VERSION_PATCH 0

#define KT__STR2(x) #x
#define KT__STR(x) KT__STR2(x)
#define KT_VERSION_STRING \
    KT__STR(KT_VERSION_MAJOR) "." KT__STR(KT_VERSION_MINOR) "." KT__STR(KT_VERSION_PATCH)
/* One comparable number: (major << 16) | (minor << 8) | patch. */
#define KT_VERSION_HEX ((KT_VERSION_MAJOR << 16) | (KT_VERSION_MINOR << 8) | KT_VERSION_PATCH)

#include "comm.h"
#include "graph.h"
#include "hf.h"
#include "hf_export.h"
#include "io.h"
#include "moe.h"
#include "ops.h"
#include "program.h"
#include "runtime.h"
#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version as built, as KT_VERSION_HEX; compare with the header's to catch a
 * header/library mismatch. */
unsigned kt_version(void);
const char *kt_version_string(void);
/* Which optional backends this build has: "openblas numa ucx cuda" (those present). */
const char *kt_build_features(void);

#ifdef __cplusplus
}
#endif
#endif
