/* Diagnostics of the .ktg parser: "file:line:col: error: what", the source line and a caret
 * line, appended to the caller's buffer (cut at its size, always NUL-terminated); and the
 * "did you mean" suggestions by edit distance. */
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/ktg/ktg_internal.h"

#define KT__KTG_SHOW_MAX 240 /* bytes of a source line shown; long lines are cut */

static void append(kt__ktg_diag *d, const char *s, size_t n)
{
    if (d->buf != NULL && d->size > 0 && d->len < d->size - 1) {
        size_t room = d->size - 1 - d->len;
        memcpy(d->buf + d->len, s, n < room ? n : room);
        d->buf[d->len + (n < room ? n : room)] = '\0';
    }
    d->len += n;
}

static void append_str(kt__ktg_diag *d, const char *s) { append(d, s, strlen(s)); }

/* The source line holding `off`, shown with control characters replaced (a NUL byte would
 * end the message early) and the caret line aligned under it (tabs copied so that the
 * caret lands under the same column whatever the tab width). */
static void show_line(kt__ktg_diag *d, kt__ktg_span at)
{
    size_t begin = at.off <= d->src_len ? at.off : d->src_len;
    while (begin > 0 && d->src[begin - 1] != '\n')
        begin--;
    size_t end = begin;
    while (end < d->src_len && d->src[end] != '\n' && end - begin < KT__KTG_SHOW_MAX)
        end++;
    char line[KT__KTG_SHOW_MAX + 8], caret[KT__KTG_SHOW_MAX + 8];
    size_t n = 0;
    for (size_t i = begin; i < end;) { /* bytes that are not UTF-8 shown as '?' */
        const unsigned char *c = (const unsigned char *)d->src + i;
        size_t len = kt__utf8_char(c, end - i);
        if (len > 1) {
            memcpy(line + n, c, len);
            n += len, i += len;
            continue;
        }
        line[n++] = len == 0 ? '?' : (c[0] == '\t' || c[0] >= 0x20) && c[0] != 0x7f ? (char)c[0] : ' ';
        i++;
    }
    while (n > 0 && (line[n - 1] == ' ' || line[n - 1] == '\r'))
        n--;
    append(d, "    ", 4);
    append(d, line, n);
    append(d, "\n", 1);
    size_t start = at.off - begin, m = 0;
    if (start > KT__KTG_SHOW_MAX)
        start = KT__KTG_SHOW_MAX;
    for (size_t i = 0; i < start;) { /* one column per character, as the line shows it */
        const unsigned char *c = (const unsigned char *)d->src + begin + i;
        size_t len = begin + i < d->src_len ? kt__utf8_char(c, d->src_len - begin - i) : 1;
        caret[m++] = len == 1 && c[0] == '\t' ? '\t' : ' ';
        i += len > 1 ? len : 1;
    }
    caret[m++] = '^';
    /* a span that runs onto a continued line is underlined to the end of this one */
    for (size_t i = 1; i < at.len && at.off + i < end && m < KT__KTG_SHOW_MAX + 1; i++)
        caret[m++] = '~';
    append(d, "    ", 4);
    append(d, caret, m);
    append(d, "\n", 1);
}

int kt__ktg_diag_error(kt__ktg_diag *d, kt__ktg_span at, int graph_error, const char *msg)
{
    if (d->n_errors >= KT__KTG_MAX_ERRORS)
        return 1;
    for (int i = 0; i < d->n_seen; i++)
        if (d->seen[i] == at.off)
            return 0; /* the same statement again, in a later iteration of a repeat */
    d->seen[d->n_seen++] = at.off;
    char head[640];
    snprintf(head, sizeof head, "%s:%d:%d: error: %s", d->filename, at.line, at.col, msg);
    if (d->n_errors == 0)
        memcpy(d->first, head, sizeof d->first < sizeof head ? sizeof d->first : sizeof head);
    append_str(d, head);
    append(d, "\n", 1);
    show_line(d, at);
    d->n_errors++;
    d->n_graph_errors += graph_error != 0;
    if (d->n_errors >= KT__KTG_MAX_ERRORS) {
        char note[128];
        snprintf(note, sizeof note, "%s: note: too many errors (%d), stopping here\n",
                 d->filename, KT__KTG_MAX_ERRORS);
        append_str(d, note);
        return 1;
    }
    return 0;
}

void kt__ktg_diag_plain(kt__ktg_diag *d, const char *msg)
{
    if (d->n_errors >= KT__KTG_MAX_ERRORS)
        return;
    char head[640];
    snprintf(head, sizeof head, "%s: error: %s", d->filename, msg);
    if (d->n_errors == 0)
        memcpy(d->first, head, sizeof d->first);
    append_str(d, head);
    append(d, "\n", 1);
    d->n_errors++;
}

int kt__ktg_edit_distance(const char *a, const char *b)
{
    enum { M = 64 };
    size_t na = strlen(a), nb = strlen(b);
    na = na > M ? M : na;
    nb = nb > M ? M : nb;
    int row[M + 1];
    for (size_t j = 0; j <= nb; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[nb];
}

int kt__ktg_is_near(const char *word, const char *candidate, int *distance_out)
{
    int dist = kt__ktg_edit_distance(word, candidate);
    /* about a third of the word: "matmull" -> "matmul", "trans" -> "trans_a"; nothing for
     * one-letter names, where every other one-letter name is one edit away */
    size_t len = strlen(word);
    int limit = len <= 1 ? 0 : (int)(len + 2) / 3;
    if (distance_out)
        *distance_out = dist;
    return dist > 0 && dist <= limit;
}

const char *kt__ktg_suggest(const char *word, const char *const *candidates, int n)
{
    const char *best = NULL;
    int best_dist = 1 << 30;
    for (int i = 0; i < n; i++) {
        int dist;
        if (kt__ktg_is_near(word, candidates[i], &dist) && dist < best_dist) {
            best = candidates[i];
            best_dist = dist;
        }
    }
    return best;
}
