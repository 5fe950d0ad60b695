/* Internal error helpers: record a message and return its status in one expression. */
#ifndef KT_CORE_ERROR_H
#define KT_CORE_ERROR_H

#include <stddef.h>

#include "kt/status.h"

#if defined(__GNUC__)
#define KT__PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define KT__PRINTF(fmt_idx, arg_idx)
#endif

/* Records "<formatted message>" as this thread's last error and returns status. */
kt_status kt__error(kt_status status, const char *fmt, ...) KT__PRINTF(2, 3);

/* Prepends "<context>: " to this thread's last error and returns status; for callers that
 * add where a failure happened (which node, which file) to a message set deeper down. */
kt_status kt__error_context(kt_status status, const char *fmt, ...) KT__PRINTF(2, 3);

/* The length of the valid UTF-8 character at s (n >= 1 bytes there), or 0 for a byte that
 * does not start one (overlong forms and surrogates included). */
size_t kt__utf8_char(const unsigned char *s, size_t n);

/* Evaluates a kt_status expression and returns it from the caller on failure. */
#define KT__TRY(expr)                   \
    do {                                \
        kt_status kt__try_s = (expr);   \
        if (kt__try_s != KT_OK)         \
            return kt__try_s;           \
    } while (0)

#endif
