/* kt-train's error reporting: one message per failure, printed and recorded. */
#include <stdarg.h>
#include <stdio.h>

#include "tools/kt-train/train.h"

static int reported; /* how many messages train_error printed */

int train_error(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* recorded first: what ranks_agree tells the other ranks, and the library's message
     * store escapes what is not printable UTF-8 (a tensor name from a file) */
    kt_set_error(KT_EINVAL, "%s", msg);
    fprintf(stderr, "kt-train: %s\n", kt_last_error());
    reported++;
    return 1;
}

int train_fail(const char *what, const char *detail)
{
    return train_error("%s%s%s", what, detail && *detail ? ": " : "", detail ? detail : "");
}

int train_errors_reported(void) { return reported; }
