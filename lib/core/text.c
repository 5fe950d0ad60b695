/* snprintf-style text accumulation (see text.h). */
#include <stdarg.h>
#include <stdio.h>

#include "lib/core/text.h"

void kt__say(kt__text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *dst = t->len < t->size ? t->buf + t->len : NULL;
    int n = vsnprintf(dst, dst ? t->size - t->len : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        t->len += (size_t)n;
}
