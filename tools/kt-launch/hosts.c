/* Ranks on other hosts: --hosts h1,h2,... spreads the ranks over the hosts in blocks (host h
 * runs ranks h*N/H .. (h+1)*N/H - 1), and each rank is started through the host command, a
 * template such as "ssh {host}" (the default) or "ip netns exec {host}": its words, {host}
 * replaced, then "env KT_RANK=... KT_WORLD_SIZE=... KT_MASTER_ADDR=... KT_MASTER_PORT=...
 * KT_JOB_ID=... [KT_COMM_TRANSPORT=...] [KT_COMM_TIMEOUT_MS=...]" and the program: the
 * variables travel on the command line, because ssh does not pass the environment. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-launch/launch.h"

int hosts_parse(const char *list, launch_hosts *h)
{
    h->n = 0;
    h->names = NULL;
    if (list == NULL || list[0] == '\0')
        return -1;
    char *copy = strdup(list);
    size_t cap = 1;
    for (const char *p = list; *p; p++)
        cap += *p == ',';
    h->names = calloc(cap, sizeof *h->names);
    if (copy == NULL || h->names == NULL)
        return -1;
    char *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save))
        h->names[h->n++] = t;
    if ((size_t)h->n != cap)
        return -1; /* an empty name: "a,,b" or a trailing comma */
    return 0;
}

int hosts_of_rank(const launch_hosts *h, int rank, int world)
{
    return (int)((long long)rank * h->n / world);
}

/* The words of the template with {host} replaced (every occurrence). */
static int template_words(const char *tmpl, const char *host, char **out, int max)
{
    int n = 0;
    char *copy = strdup(tmpl), *save = NULL;
    if (copy == NULL)
        return -1;
    for (char *w = strtok_r(copy, " \t", &save); w != NULL && n < max;
         w = strtok_r(NULL, " \t", &save)) {
        size_t len = strlen(w) + 1, hl = strlen(host);
        for (const char *p = strstr(w, "{host}"); p != NULL; p = strstr(p + 6, "{host}"))
            len += hl;
        char *word = malloc(len), *o = word;
        if (word == NULL)
            return -1;
        for (const char *p = w; *p;) {
            if (strncmp(p, "{host}", 6) == 0) {
                memcpy(o, host, hl);
                o += hl;
                p += 6;
            } else {
                *o++ = *p++;
            }
        }
        *o = '\0';
        out[n++] = word;
    }
    return n;
}

char **hosts_command(const launch_hosts *h, int rank, int world, char **prog)
{
    static const char *const vars[] = {"KT_RANK",     "KT_WORLD_SIZE",     "KT_MASTER_ADDR",
                                       "KT_MASTER_PORT", "KT_JOB_ID",      "KT_COMM_TRANSPORT",
                                       "KT_COMM_TIMEOUT_MS"};
    const int n_vars = (int)(sizeof vars / sizeof vars[0]);
    int n_prog = 0;
    while (prog[n_prog] != NULL)
        n_prog++;
    char **argv = calloc((size_t)(64 + 1 + n_vars + n_prog + 1), sizeof *argv);
    if (argv == NULL)
        return NULL;
    int n = template_words(h->command, h->names[hosts_of_rank(h, rank, world)], argv, 64);
    if (n <= 0)
        return NULL;
    argv[n++] = "env";
    for (int i = 0; i < n_vars; i++) {
        const char *v = getenv(vars[i]);
        if (v == NULL)
            continue;
        char *kv = malloc(strlen(vars[i]) + strlen(v) + 2);
        if (kv == NULL)
            return NULL;
        sprintf(kv, "%s=%s", vars[i], v);
        argv[n++] = kv;
    }
    for (int i = 0; i < n_prog; i++)
        argv[n++] = prog[i];
    argv[n] = NULL;
    return argv;
}
