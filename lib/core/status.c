/* Status names and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"

#define KT__ERROR_MAX 1024

static _Thread_local char last_error[KT__ERROR_MAX];

const char *kt_status_str(kt_status status)
{
    switch (status) {
#define KT__STATUS_CASE(name, value, text) \
    case KT_##name:                        \
        return text;
        KT_STATUS_LIST(KT__STATUS_CASE)
#undef KT__STATUS_CASE
    }
    return "unknown status";
}

const char *kt_last_error(void) { return last_error; }

void kt_clear_error(void) { last_error[0] = '\0'; }

kt_status kt__error(kt_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

kt_status kt_set_error(kt_status status, const char *fmt, ...)
{
    char msg[KT__ERROR_MAX]; /* the arguments may be kt_last_error() itself */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(last_error, msg, sizeof last_error);
    return status;
}

kt_status kt__error_context(kt_status status, const char *fmt, ...)
{
    char prefix[KT__ERROR_MAX];
    char inner[KT__ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(inner, last_error, sizeof inner);
    const char *rest = inner[0] != '\0' ? inner : kt_status_str(status);
    /* Built piecewise: a message that does not fit is cut, on purpose. */
    size_t n = strlen(prefix);
    memcpy(last_error, prefix, n + 1);
    if (n + 2 < sizeof last_error) {
        memcpy(last_error + n, ": ", 3);
        n += 2;
        size_t m = strlen(rest);
        if (m > sizeof last_error - 1 - n)
            m = sizeof last_error - 1 - n;
        memcpy(last_error + n, rest, m);
        last_error[n + m] = '\0';
    }
    return status;
}
