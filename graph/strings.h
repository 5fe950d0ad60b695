/* A string pool: names stored back to back, NUL-terminated, referred to by offset. Offsets
 * stay valid as the pool grows (pointers do not). */
#ifndef KT_GRAPH_STRINGS_H
#define KT_GRAPH_STRINGS_H

#include <stddef.h>
#include <stdint.h>

#include "kt/status.h"

typedef struct kt__strings {
    char *data;
    size_t len, cap;
} kt__strings;

/* Appends s; *offset_out receives its offset. */
kt_status kt__strings_add(kt__strings *pool, const char *s, int32_t *offset_out);
/* The string at offset, or "" for offset -1. */
const char *kt__strings_get(const kt__strings *pool, int32_t offset);
void kt__strings_free(kt__strings *pool);

#endif
