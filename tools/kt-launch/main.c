/* kt-launch: starts N ranks of a program on this machine for the UCX communicator.
 *
 *   kt-launch -n N [--transport shm|tcp] [--port P] [--timeout-ms MS] [--grace-ms MS]
 *             [--keep-going] [--hosts H1,H2,... [--host-cmd TEMPLATE] [--master-addr A]]
 *             -- program args...
 *   kt-launch --print-env [-n RANKS_PER_HOST] [--port P] HOSTS...
 *
 * Each rank gets KT_RANK, KT_WORLD_SIZE, KT_MASTER_ADDR=127.0.0.1 and KT_MASTER_PORT (a free
 * port unless --port), KT_COMM_TRANSPORT with --transport, KT_COMM_TIMEOUT_MS with
 * --timeout-ms. Its stdout and stderr lines come out prefixed with "[rank r] ". SIGINT and
 * SIGTERM are forwarded to the ranks. When a rank fails (non-zero exit or a signal) the
 * others are stopped (SIGTERM, then SIGKILL after the grace period) and kt-launch exits with
 * that rank's status (128 + signal for a signal); --keep-going lets the others finish (the
 * fault tests, where one rank is meant to die). Signals go to each rank's process group, so
 * what a rank started goes too, also after the rank itself has exited; once every rank has
 * exited, processes they left behind holding their output get the grace period, then SIGTERM
 * and SIGKILL. If kt-launch itself is killed (SIGKILL), its guard process kills the process
 * groups of the ranks still running. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tools/common/free_port.h"
#include "tools/common/rank_env.h"
#include "tools/common/usage.h"
#include "tools/kt-launch/launch.h"
#ifdef __linux__
#include <sys/prctl.h>
#endif

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    unsigned char c = (unsigned char)sig;
    int saved = errno;
    if (write(sig_pipe[1], &c, 1) < 0) {
        /* the pipe is full: the loop will wake up anyway */
    }
    errno = saved;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-launch -n N [options] -- program [args...]\n"
            "       kt-launch --print-env [-n RANKS_PER_HOST] [--port P] [--transport T] HOSTS...\n"
            "\n"
            "Starts N ranks of program on this machine for libkt's UCX communicator, with\n"
            "KT_RANK, KT_WORLD_SIZE, KT_MASTER_ADDR=127.0.0.1 and KT_MASTER_PORT set, and\n"
            "prefixes their output lines with \"[rank r] \".\n"
            "\n"
            "options:\n"
            "  -n N              number of ranks (with --print-env: ranks per host, default 1)\n"
            "  --transport T     shm or tcp (sets KT_COMM_TRANSPORT; default: UCX's choice)\n"
            "  --port P          rendezvous port (default: a free port; 29500 with --print-env)\n"
            "  --timeout-ms MS   the communicator deadline (sets KT_COMM_TIMEOUT_MS)\n"
            "  --grace-ms MS     after a failure, SIGTERM then SIGKILL after MS (default 3000);\n"
            "                    also how long processes the exited ranks left behind may\n"
            "                    hold their output before they are stopped the same way\n"
            "  --keep-going      let the other ranks run on when one fails\n"
            "  --hosts H1,H2,... start the ranks on these hosts, in blocks of N / hosts (N a\n"
            "                    multiple of their count; rank 0 on H1), each through the\n"
            "                    host command with the KT_* variables on its command line\n"
            "  --host-cmd T      the host command: its words, {host} replaced, then\n"
            "                    \"env KT_RANK=... ... program args\" (default \"ssh {host}\";\n"
            "                    network namespaces: \"ip netns exec {host}\")\n"
            "  --master-addr A   rank 0's address the others connect to (default with\n"
            "                    --hosts: H1; without: 127.0.0.1)\n"
            "  --print-env       print the environment each host needs for a multi-host run\n"
            "                    (the first host is the master); starts nothing\n"
            "  -h, --help        this text\n"
            "\n"
            "exit status: 0 when every rank exited 0; else the first failing rank's status\n"
            "(128 + signal number when it was killed by a signal); 128 + the signal when\n"
            "kt-launch itself got SIGINT or SIGTERM; 2 for a usage error.\n"
            "\n"
            "Each rank runs in its own process group. If kt-launch is killed (SIGKILL), a\n"
            "guard process it started kills the groups of the ranks still running.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

/* A job id for this launch, from /dev/urandom (else the clock and pid): the communicator's
 * master refuses ranks of another job that reach its port (KT_JOB_ID). */
static void make_job_id(char out[32])
{
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &x, sizeof x) != (ssize_t)sizeof x) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^
            ((uint64_t)getpid() << 32);
    }
    if (fd >= 0)
        close(fd);
    snprintf(out, 32, "kt-%016llx", (unsigned long long)x);
}

static int print_env(int per_host, int port, const char *transport, const char *timeout,
                     int n_hosts, char **hosts)
{
    char job_id[32];
    make_job_id(job_id);
    int world = per_host * n_hosts;
    printf("# %d host(s) x %d rank(s); start each line's command on its host\n", n_hosts,
           per_host);
    for (int h = 0; h < n_hosts; h++)
        for (int i = 0; i < per_host; i++) {
            printf("%s: KT_RANK=%d KT_WORLD_SIZE=%d KT_MASTER_ADDR=%s KT_MASTER_PORT=%d "
                   "KT_JOB_ID=%s", hosts[h], h * per_host + i, world, hosts[0], port, job_id);
            if (transport != NULL)
                printf(" KT_COMM_TRANSPORT=%s", transport);
            if (timeout != NULL)
                printf(" KT_COMM_TIMEOUT_MS=%s", timeout);
            printf("\n");
        }
    return 0;
}

static void signal_all(rank_proc *ranks, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (group_alive(&ranks[r])) {
            /* The rank's process group: a shell's children must go too, or they keep the
             * output pipes open (also after the rank itself has exited). */
            if (kill(-ranks[r].pid, sig) != 0 && ranks[r].running)
                kill(ranks[r].pid, sig);
            if (sig == SIGTERM && kill(-ranks[r].pid, SIGCONT) != 0 && ranks[r].running)
                kill(ranks[r].pid, SIGCONT); /* a stopped rank must run to see SIGTERM */
        }
}

static int exit_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 1;
}

static launch_hosts hosts = {.command = "ssh {host}"};
static const char *master_addr;

static pid_t spawn(int rank, int n, int port, const char *job_id, const char *transport,
                   const char *timeout, char **argv, int out_fd[2], int err_fd[2])
{
    /* kt-launch's handlers must never run in a rank: a SIGTERM between fork and the reset
     * below (kt-launch stopping the ranks as this one starts, on a loaded machine) ran them in
     * the child, which wrote to kt-launch's signal pipe, so kt-launch took its own stop for a
     * signal to itself (exit 143 instead of the failed rank's status), and the rank lived on
     * until the grace period's SIGKILL. Signals stay blocked across fork; the child unblocks
     * them once the defaults are back, and a pending one then acts as the default. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t pid = fork();
    if (pid != 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        return pid;
    }
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old, NULL);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphaned ranks if kt-launch itself is killed */
#endif
    setpgid(0, 0); /* signals reach a rank once, through kt-launch */
    dup2(out_fd[1], STDOUT_FILENO);
    dup2(err_fd[1], STDERR_FILENO);
    close(out_fd[0]);
    close(out_fd[1]);
    close(err_fd[0]);
    close(err_fd[1]);
    kt_tool_set_rank_env(rank, n, port, job_id, transport);
    if (timeout != NULL)
        setenv("KT_COMM_TIMEOUT_MS", timeout, 1);
    if (master_addr != NULL)
        setenv("KT_MASTER_ADDR", master_addr, 1);
    if (hosts.n > 0 && (argv = hosts_command(&hosts, rank, n, argv)) == NULL) {
        fprintf(stderr, "kt-launch: rank %d: cannot build the host command\n", rank);
        _exit(127);
    }
    execvp(argv[0], argv);
    fprintf(stderr, "kt-launch: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

int main(int argc, char **argv)
{
    int n = 0, port = 0, grace_ms = 3000, keep_going = 0, env_mode = 0, timeout_ms = 0;
    const char *transport = NULL, *timeout = NULL;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return tool_finish_stdout("kt-launch");
        } else if (strcmp(a, "-n") == 0 && has) {
            if (parse_int(argv[++i], 1, 4096, &n) != 0) {
                fprintf(stderr, "kt-launch: -n needs a number of ranks in 1..4096\n");
                return 2;
            }
        } else if (strcmp(a, "--port") == 0 && has) {
            if (parse_int(argv[++i], 1, 65535, &port) != 0) {
                fprintf(stderr, "kt-launch: --port needs a port in 1..65535\n");
                return 2;
            }
        } else if (strcmp(a, "--timeout-ms") == 0 && has) {
            timeout = argv[++i];
            if (parse_int(timeout, 1, 1 << 30, &timeout_ms) != 0) {
                fprintf(stderr, "kt-launch: --timeout-ms needs a positive number\n");
                return 2;
            }
        } else if (strcmp(a, "--grace-ms") == 0 && has) {
            if (parse_int(argv[++i], 0, 1 << 30, &grace_ms) != 0) {
                fprintf(stderr, "kt-launch: --grace-ms needs a number\n");
                return 2;
            }
        } else if (strcmp(a, "--transport") == 0 && has) {
            transport = argv[++i];
            if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
                fprintf(stderr, "kt-launch: --transport is shm or tcp, not '%s'\n", transport);
                return 2;
            }
        } else if (strcmp(a, "--keep-going") == 0) {
            keep_going = 1;
        } else if (strcmp(a, "--hosts") == 0 && has) {
            if (hosts_parse(argv[++i], &hosts) != 0) {
                fprintf(stderr, "kt-launch: --hosts needs host names separated by commas, "
                        "not '%s'\n", argv[i]);
                return 2;
            }
        } else if (strcmp(a, "--host-cmd") == 0 && has) {
            hosts.command = argv[++i];
            if (strstr(hosts.command, "{host}") == NULL) {
                fprintf(stderr, "kt-launch: --host-cmd '%s' does not name {host}\n",
                        hosts.command);
                return 2;
            }
        } else if (strcmp(a, "--master-addr") == 0 && has) {
            master_addr = argv[++i];
        } else if (strcmp(a, "--print-env") == 0) {
            env_mode = 1;
        } else if (!has && (strcmp(a, "-n") == 0 || strcmp(a, "--port") == 0 ||
                            strcmp(a, "--timeout-ms") == 0 || strcmp(a, "--grace-ms") == 0 ||
                            strcmp(a, "--transport") == 0 || strcmp(a, "--hosts") == 0 ||
                            strcmp(a, "--host-cmd") == 0 || strcmp(a, "--master-addr") == 0)) {
            fprintf(stderr, "kt-launch: %s needs a value (see --help)\n", a);
            return 2;
        } else if (a[0] == '-') {
            fprintf(stderr, "kt-launch: unknown option '%s' (see --help)\n", a);
            return 2;
        } else {
            break;
        }
    }
    if (env_mode) {
        if (i >= argc) {
            fprintf(stderr, "kt-launch: --print-env needs at least one host\n");
            return 2;
        }
        for (int h = i; h < argc; h++)
            if (argv[h][0] == '-') {
                fprintf(stderr, "kt-launch: '%s' after the hosts: options go before them\n",
                        argv[h]);
                return 2;
            }
        int rc = print_env(n > 0 ? n : 1, port > 0 ? port : 29500, transport, timeout,
                           argc - i, argv + i);
        int out = tool_finish_stdout("kt-launch");
        return rc != 0 ? rc : out;
    }
    if (n <= 0 || i >= argc) {
        usage(stderr);
        return 2;
    }
    char **prog = argv + i;
    if (hosts.n > 0 && n % hosts.n != 0) {
        fprintf(stderr, "kt-launch: -n %d ranks do not split evenly over the %d hosts of "
                "--hosts\n", n, hosts.n);
        return 2;
    }
    if (hosts.n > 0 && master_addr == NULL)
        master_addr = hosts.names[0];
    if (port == 0 && (port = kt_tool_free_port()) < 0) {
        fprintf(stderr, "kt-launch: cannot find a free port on 127.0.0.1: %s\n", strerror(errno));
        return 1;
    }

    char job_id[32];
    make_job_id(job_id);
    guard_start(n); /* first: it must hold none of the pipes below */
    rank_proc *ranks = calloc((size_t)n, sizeof *ranks);
    struct pollfd *pfd = calloc((size_t)(2 * n + 1), sizeof *pfd);
    int *pfd_rank = calloc((size_t)(2 * n + 1), sizeof *pfd_rank);
    if (ranks == NULL || pfd == NULL || pfd_rank == NULL || pipe(sig_pipe) != 0) {
        fprintf(stderr, "kt-launch: out of resources\n");
        return 1;
    }
    fcntl(sig_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
    fcntl(sig_pipe[0], F_SETFD, FD_CLOEXEC);
    fcntl(sig_pipe[1], F_SETFD, FD_CLOEXEC);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    for (int r = 0; r < n; r++) {
        int out_fd[2], err_fd[2];
        if (pipe(out_fd) != 0 || pipe(err_fd) != 0) {
            fprintf(stderr, "kt-launch: pipe: %s\n", strerror(errno));
            signal_all(ranks, r, SIGKILL);
            return 1;
        }
        fcntl(out_fd[0], F_SETFD, FD_CLOEXEC);
        fcntl(err_fd[0], F_SETFD, FD_CLOEXEC);
        pid_t pid = spawn(r, n, port, job_id, transport, timeout, prog, out_fd, err_fd);
        close(out_fd[1]);
        close(err_fd[1]);
        if (pid > 0)
            setpgid(pid, pid); /* also here: a signal may come before the child ran */
        if (pid < 0) {
            fprintf(stderr, "kt-launch: fork: %s\n", strerror(errno));
            signal_all(ranks, r, SIGKILL);
            return 1;
        }
        ranks[r] = (rank_proc){.pid = pid, .running = 1, .guarded = 1, .open = {1, 1}};
        guard_send(pid);
        ranks[r].streams[0] = (stream){.fd = out_fd[0]};
        ranks[r].streams[1] = (stream){.fd = err_fd[0]};
    }
    int ctl = -1;
    pid_t relay = relay_start(ranks, n, (const int[]){guard_pipe_fd(), sig_pipe[0], sig_pipe[1]}, 3,
                               &ctl);
    if (relay < 0) {
        fprintf(stderr, "kt-launch: cannot start the output relay: %s\n", strerror(errno));
        signal_all(ranks, n, SIGKILL);
        return 1;
    }

    int failed_rank = -1, result = 0, running = n, open_streams = 2 * n;
    int got_signal = 0, stopping = 0, linger_stage = 0;
    /* Deadlines in ms (-1: none): the SIGKILL of what a SIGTERM did not stop, and, once every
     * rank has exited, how long processes they left behind may still hold their output. */
    int64_t kill_at = -1, linger_at = -1;
    while (running > 0 || open_streams > 0) {
        int np = 0;
        pfd[np] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
        pfd_rank[np++] = -1;
        if (ctl >= 0) {
            pfd[np] = (struct pollfd){.fd = ctl, .events = POLLIN};
            pfd_rank[np++] = 0;
        }
        int64_t next = kill_at >= 0 && (linger_at < 0 || kill_at < linger_at) ? kill_at
                                                                               : linger_at;
        int wait = -1;
        if (next >= 0) {
            int64_t left = next - now_ms();
            wait = left < 0 ? 0 : left > 1 << 30 ? 1 << 30 : (int)left;
        }
        int k = poll(pfd, (nfds_t)np, wait);
        if (k < 0 && errno != EINTR) {
            fprintf(stderr, "kt-launch: poll: %s\n", strerror(errno));
            signal_all(ranks, n, SIGKILL);
            return 1;
        }
        if (k > 0 && np > 1 && pfd[1].revents != 0) {
            int32_t ends[64];
            ssize_t got = read(ctl, ends, sizeof ends);
            if (got <= 0 && !(got < 0 && (errno == EINTR || errno == EAGAIN))) {
                /* the relay is gone: nothing holds the ranks' output any more */
                close(ctl);
                ctl = -1;
                for (int r = 0; r < n; r++)
                    ranks[r].open[0] = ranks[r].open[1] = 0;
                open_streams = 0;
            }
            for (ssize_t e = 0; e < got / (ssize_t)sizeof ends[0]; e++) {
                int32_t x = ends[e]; /* whole messages: 4 bytes, written at once */
                if (x >= 0 && x < 2 * n && ranks[x / 2].open[x % 2]) {
                    ranks[x / 2].open[x % 2] = 0;
                    open_streams--;
                }
            }
        }
        if (k > 0 && pfd[0].revents != 0) {
            unsigned char sigs[64];
            ssize_t got = read(sig_pipe[0], sigs, sizeof sigs);
            for (ssize_t s = 0; s < got; s++) {
                if (sigs[s] != SIGINT && sigs[s] != SIGTERM)
                    continue;
                /* Forwarded; a second one, or the grace period, escalates to SIGKILL. The
                 * exit status is then 128 + the first signal, whatever the ranks' */
                signal_all(ranks, n, stopping ? SIGKILL : sigs[s]);
                if (!stopping)
                    kill_at = now_ms() + grace_ms;
                stopping = 1;
                if (!got_signal)
                    result = 128 + sigs[s];
                got_signal = 1;
            }
        }
        pid_t pid;
        int status;
        while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED)) > 0) {
            if (pid == relay)
                relay = -1;
            for (int r = 0; r < n; r++) {
                if (ranks[r].pid != pid || !ranks[r].running)
                    continue;
                if (WIFSTOPPED(status)) {
                    /* A stopped rank stalls every collective: its peers would wait for their
                     * deadline (60 s by default). Unless the stop is the point (--keep-going,
                     * the fault tests), the job ends now, named. */
                    fprintf(stderr, "kt-launch: rank %d was stopped by signal %d (%s)%s\n", r,
                            WSTOPSIG(status), strsignal(WSTOPSIG(status)),
                            WSTOPSIG(status) == SIGTTIN || WSTOPSIG(status) == SIGTTOU
                                ? ": it used the terminal, which belongs to kt-launch"
                                : "");
                    if (keep_going || failed_rank >= 0 || stopping)
                        continue;
                    failed_rank = r;
                    if (!got_signal)
                        result = 128 + WSTOPSIG(status);
                    fprintf(stderr, "kt-launch: stopping the job\n");
                    signal_all(ranks, n, SIGTERM); /* with SIGCONT, so the stopped one sees it */
                    stopping = 1;
                    kill_at = now_ms() + grace_ms;
                    continue;
                }
                ranks[r].running = 0;
                ranks[r].status = status;
                running--;
                int code = exit_code(status);
                if (code != 0 && failed_rank < 0) {
                    failed_rank = r;
                    if (WIFSIGNALED(status))
                        fprintf(stderr, "kt-launch: rank %d was killed by signal %d (%s)\n", r,
                                WTERMSIG(status), strsignal(WTERMSIG(status)));
                    else
                        fprintf(stderr, "kt-launch: rank %d exited with status %d\n", r, code);
                    if (!got_signal)
                        result = code;
                    if (!keep_going && !stopping) {
                        fprintf(stderr, "kt-launch: stopping the other ranks\n");
                        signal_all(ranks, n, SIGTERM); /* with what the failed one left behind */
                        stopping = 1;
                        kill_at = now_ms() + grace_ms;
                    }
                }
            }
        }
        const int64_t now = now_ms();
        if (kill_at >= 0 && now >= kill_at) {
            signal_all(ranks, n, SIGKILL); /* SIGKILL needs no second round */
            kill_at = -1;
        }
        if (running == 0 && open_streams > 0 && linger_at < 0) {
            linger_at = now + grace_ms;
        } else if (running == 0 && open_streams > 0 && now >= linger_at) {
            if (linger_stage == 0) {
                fprintf(stderr, "kt-launch: every rank has exited, but processes they started "
                        "still hold their output: stopping them\n");
                signal_all(ranks, n, SIGTERM);
                linger_at = now + grace_ms;
            } else if (linger_stage == 1) {
                signal_all(ranks, n, SIGKILL);
                linger_at = now + 1000;
            } else {
                fprintf(stderr, "kt-launch: the ranks' output is held open outside their "
                        "process groups; not waiting for it\n");
                for (int r = 0; r < n; r++)
                    ranks[r].open[0] = ranks[r].open[1] = 0;
                open_streams = 0;
            }
            linger_stage++;
        }
        guard_forget_finished(ranks, n);
    }
    guard_forget_finished(ranks, n);
    if (ctl >= 0)
        close(ctl); /* the relay writes out what it holds, then exits */
    /* Its last lines before kt-launch's exit, unless nothing reads them: then it finishes
     * on its own (it holds the output, so a pipe's reader still gets everything). */
    for (int64_t until = now_ms() + 2000; relay > 0 && now_ms() < until;) {
        if (waitpid(relay, NULL, WNOHANG) == relay)
            break;
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    free(ranks);
    free(pfd);
    free(pfd_rank);
    return result;
}
