/* Text built into a caller's buffer with snprintf semantics: writes what fits (always
 * NUL-terminated when size > 0) and counts the full length, for the kt_program_describe /
 * kt_program_dot contract. */
#ifndef KT_CORE_TEXT_H
#define KT_CORE_TEXT_H

#include <stddef.h>

typedef struct kt__text {
    char *buf;
    size_t size, len;
} kt__text;

void kt__say(kt__text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
