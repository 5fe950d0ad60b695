/* Admission of planned memory: a session or MoE layer checks what it is about to commit
 * against what the machine can give (kt_memory_available) before allocating any of it, so a
 * plan larger than memory is refused at once instead of paging towards the OOM killer. */
#ifndef KT_CORE_MEMORY_H
#define KT_CORE_MEMORY_H

#include <stddef.h>
#include <stdint.h>

#include "kt/status.h"

/* KT_OK when `bytes` fits in what is available; else KT_ENOMEM "<what> needs 33.6 GB of
 * memory, but 21.9 GB is available (MemAvailable ...)". */
kt_status kt__memory_admit(uint64_t bytes, const char *what);

#endif
