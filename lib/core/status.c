/* Status names and the thread-local last-error message.
 *
 * Every message is stored as valid UTF-8 with no control characters (bytes of other
 * encodings and escapes in a name the user gave become \xNN), and fits the buffer without
 * losing its reason: when it would not, each overlong word (a 1000-byte tensor name) is cut
 * to its start and end first, and only then the message's tail. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"

#define KT__ERROR_MAX 1024
#define WORD_MAX 96   /* a word longer than this is shortened when the message is too long */
#define WORD_HEAD 48  /* bytes kept from a shortened word's start ... */
#define WORD_TAIL 24  /* ... and from its end */

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

size_t kt__utf8_char(const unsigned char *s, size_t n)
{
    if (s[0] < 0x80)
        return 1;
    size_t len = s[0] >= 0xc2 && s[0] <= 0xdf ? 2 : s[0] >= 0xe0 && s[0] <= 0xef ? 3
               : s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : 0;
    if (len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] > 0x9f) ||
        (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] > 0x8f))
        return 0;
    return len;
}

/* One unit of the stored message: a printable character as it is, anything else as \xNN.
 * Returns the raw bytes it consumes; *shown its length as stored. */
static size_t unit_at(const unsigned char *s, size_t n, size_t *shown)
{
    size_t len = kt__utf8_char(s, n);
    int control = len == 1 && (s[0] < 0x20 || s[0] == 0x7f);
    *shown = len == 0 || control ? 4 : len;
    return len == 0 || control ? 1 : len;
}

static size_t put_unit(const unsigned char *s, size_t n, char *out)
{
    size_t shown, used = unit_at(s, n, &shown);
    if (shown == 4 && used == 1)
        snprintf(out, 5, "\\x%02x", s[0]);
    else
        memcpy(out, s, used);
    return used;
}

/* The stored length of raw[0, n). */
static size_t shown_length(const unsigned char *raw, size_t n)
{
    size_t total = 0, shown;
    for (size_t i = 0; i < n; i += unit_at(raw + i, n - i, &shown))
        total += (unit_at(raw + i, n - i, &shown), shown);
    return total;
}

/* raw[0, n) into last_error, escaped; shortened as the header says when it does not fit. */
static void store(const char *raw_chars, size_t n)
{
    const unsigned char *raw = (const unsigned char *)raw_chars;
    char out[KT__ERROR_MAX];
    const int shorten = shown_length(raw, n) >= sizeof out;
    size_t len = 0, i = 0;
    while (i < n) {
        size_t word = 0; /* a run of non-blank bytes from i */
        while (i + word < n && raw[i + word] != ' ')
            word++;
        size_t stop = word > 0 ? i + word : i + 1, skip_from = stop, skip_to = stop;
        if (shorten && shown_length(raw + i, word) > WORD_MAX) { /* keep its head and tail */
            skip_from = i + WORD_HEAD;
            skip_to = stop - WORD_TAIL;
        }
        while (i < stop) {
            if (i >= skip_from) { /* (the head's last character may end past skip_from) */
                if (len + 3 >= sizeof out - 4)
                    goto cut;
                memcpy(out + len, "...", 3);
                len += 3;
                i = skip_to > i ? skip_to : i;
                while (i < stop && (raw[i] & 0xc0) == 0x80) /* on to a whole character */
                    i++;
                skip_from = stop;
                continue;
            }
            size_t shown;
            unit_at(raw + i, n - i, &shown);
            if (len + shown >= sizeof out - 4)
                goto cut;
            i += put_unit(raw + i, n - i, out + len);
            len += shown;
        }
    }
    out[len] = '\0';
    memcpy(last_error, out, len + 1);
    return;
cut: /* the rest does not fit even with its long words shortened */
    memcpy(out + len, "...", 4);
    memcpy(last_error, out, len + 4);
}

/* fmt formatted whole (on the heap when it is long) and stored. */
static void store_formatted(const char *fmt, va_list ap)
{
    char small[4096];
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    char *big = n >= (int)sizeof small ? malloc((size_t)n + 1) : NULL;
    if (big != NULL)
        vsnprintf(big, (size_t)n + 1, fmt, again);
    va_end(again);
    if (n < 0)
        n = 0;
    store(big != NULL ? big : small, big != NULL || n < (int)sizeof small ? (size_t)n
                                                                           : sizeof small - 1);
    free(big);
}

kt_status kt__error(kt_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    store_formatted(fmt, ap);
    va_end(ap);
    return status;
}

kt_status kt_set_error(kt_status status, const char *fmt, ...)
{
    va_list ap; /* the arguments may be kt_last_error() itself: formatted before stored */
    va_start(ap, fmt);
    store_formatted(fmt, ap);
    va_end(ap);
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
    char joined[2 * KT__ERROR_MAX + 2];
    int n = snprintf(joined, sizeof joined, "%s: %s", prefix, rest);
    store(joined, n < 0 ? 0 : (size_t)n < sizeof joined ? (size_t)n : sizeof joined - 1);
    return status;
}
