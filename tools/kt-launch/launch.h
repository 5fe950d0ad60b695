/* kt-launch: the parts of the launcher, one file per job.
 *
 *   main.c   options, starting the ranks, watching them, exit status
 *   guard.c  the process that kills the ranks' groups if kt-launch is SIGKILLed
 *   relay.c  the process that prefixes the ranks' output lines and never blocks them
 *   hosts.c  --hosts: which host runs a rank, and the command that starts it there */
#ifndef KT_LAUNCH_H
#define KT_LAUNCH_H

#include <stddef.h>
#include <sys/types.h>

typedef struct stream {
    int fd;      /* -1 once closed */
    char buf[4096];
    size_t len;
} stream;

typedef struct rank_proc {
    pid_t pid;
    int running;
    int status;  /* waitpid status */
    int guarded; /* the guard holds its process group (started, group not yet known empty) */
    int open[2]; /* its stdout / stderr pipe has a writer still (the relay reports the ends) */
    stream streams[2]; /* the read ends: the relay's */
} rank_proc;

/* Whether rank r's process group may still have members: its leader runs, or something still
 * holds its output pipes (a child it left behind). An exited rank whose pipes are closed is
 * not signalled: its pid, and so its group id, may belong to another process by now. */
static inline int group_alive(const rank_proc *r)
{
    return r->running || r->open[0] || r->open[1];
}

/* ---- guard.c ---- */
/* Starts the guard for up to n ranks (none if it cannot: the ranks still get PDEATHSIG). */
void guard_start(int n);
/* Hands the guard a rank's process group (pid > 0) or tells it the group is empty (-pid). */
void guard_send(pid_t msg);
/* Tells the guard which ranks' groups are now empty. */
void guard_forget_finished(rank_proc *ranks, int n);
/* kt-launch's end of the guard's pipe (-1 without a guard): processes kt-launch forks
 * besides the ranks close it, so that the guard sees kt-launch's end, not theirs. */
int guard_pipe_fd(void);

/* ---- relay.c ---- */
/* Starts the relay over every rank's read ends, which kt-launch then closes; *ctl_out is
 * kt-launch's end of the socket the relay reports on. The relay closes the n_close fds of
 * close_in_child first. -1 if it cannot be started. */
pid_t relay_start(rank_proc *ranks, int n, const int *close_in_child, int n_close,
                  int *ctl_out);

/* ---- hosts.c ---- */
typedef struct launch_hosts {
    int n;             /* 0: every rank on this machine */
    char **names;
    const char *command; /* the template: "ssh {host}", "ip netns exec {host}" */
} launch_hosts;
/* Splits "h1,h2,..." into h->names; -1 for an empty list or an empty name. */
int hosts_parse(const char *list, launch_hosts *h);
/* The host (index into names) of a rank: blocks of world / n ranks. */
int hosts_of_rank(const launch_hosts *h, int rank, int world);
/* In the forked child, after the rank's KT_* variables are set: the argv that starts the
 * program on the rank's host (the template's words, env with the KT_* variables, the
 * program). NULL when out of memory or the template is empty. */
char **hosts_command(const launch_hosts *h, int rank, int world, char **prog);

#endif
