/* A session's failures with several ranks, and the fault-injection test hook.
 *
 * A rank whose forward, backward or optimizer step fails has left its peers out of step: the
 * session tells them through kt_comm_abort, with the training step and the op in the
 * message, so every rank reports that root cause ("rank 1: step 41: cross_entropy 'loss'
 * (forward): ...") instead of a mismatch or a deadline.
 *
 * KT_FAULT (a test hook, docs/parallel.md): read when a session is created,
 *   KT_FAULT="rank=R,step=S,phase=forward|backward|step[,op=NAME|INDEX]"
 * makes the op of the phase of training step S (1-based: the step after S-1 optimizer steps)
 * fail on rank R (every rank when rank is left out) once. op: an op name (cross_entropy) or a
 * node name, the first of the phase that matches; or a number, the phase's op kernels
 * counted from 0; left out: the phase's first. phase=step fails the optimizer step (before
 * its gradient all-reduce), phase=save the first kt_session_save after step S (before
 * anything is written). hold=MS: instead of failing, the op (or the save) first waits MS
 * milliseconds, then runs: a slow or hung rank, which a test may kill or stop meanwhile. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/runtime/session_internal.h"
#include "kt/comm.h"
#include "lib/core/error.h"

static const char *const phase_names[] = {"forward", "backward", "step", "save"};

/* The program steps [begin, end) of a phase (forward or backward). */
static void phase_range(const kt_session *s, int phase, int32_t *begin, int32_t *end)
{
    *begin = phase == KT__FAULT_FORWARD ? 0 : s->p->n_forward;
    *end = phase == KT__FAULT_FORWARD ? s->p->n_forward : s->p->n_steps;
}

static kt_status bad_fault(const char *spec, const char *why, const char *what)
{
    return kt__error(KT_EINVAL, "KT_FAULT=\"%s\": %s%s (the test hook takes "
                     "rank=R,step=S,phase=forward|backward|step|save[,op=NAME|INDEX][,hold=MS])", spec, why,
                     what);
}

static int parse_int(const char *v, long long lo, long long *out)
{
    char *end;
    long long x = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo)
        return -1;
    *out = x;
    return 0;
}

/* The program step of op `op` (a name or an index) in the phase, or -1; *count_out: how many
 * op kernels the phase runs. */
static int32_t find_op(const kt_session *s, int phase, const char *op, int32_t *count_out)
{
    int32_t begin, end, n = 0, found = -1;
    long long index = -1;
    phase_range(s, phase, &begin, &end);
    if (op != NULL && parse_int(op, 0, &index) != 0)
        index = -2; /* a name */
    for (int32_t at = begin; at < end; at++) {
        const kt__pstep *ps = &s->p->steps[at];
        if (s->exec[at].kernel == NULL)
            continue;
        int match = op == NULL ? n == 0
                    : index >= 0 ? n == index
                                 : strcmp(kt_op_name(ps->op), op) == 0 ||
                                       strcmp(kt__strings_get(&s->p->strings, ps->name), op) == 0;
        if (match && found < 0)
            found = at;
        n++;
    }
    *count_out = n;
    return found;
}

kt_status kt__session_fault_parse(kt_session *s)
{
    s->fault.phase = -1;
    const char *env = getenv("KT_FAULT");
    if (env == NULL || env[0] == '\0')
        return KT_OK;
    kt__fault *f = &s->fault;
    snprintf(f->spec, sizeof f->spec, "%s", env);
    if (strlen(env) >= sizeof f->spec)
        return bad_fault(f->spec, "longer than ", "127 bytes");
    char buf[sizeof f->spec], *save = NULL;
    memcpy(buf, f->spec, sizeof buf);
    long long rank = -1, step = 1;
    int phase = KT__FAULT_FORWARD;
    const char *op = NULL;
    for (char *kv = strtok_r(buf, ",", &save); kv != NULL; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        if (eq == NULL)
            return bad_fault(f->spec, "not KEY=VALUE: ", kv);
        *eq = '\0';
        const char *v = eq + 1;
        if (strcmp(kv, "rank") == 0) {
            if (parse_int(v, 0, &rank) != 0)
                return bad_fault(f->spec, "rank is not a rank: ", v);
        } else if (strcmp(kv, "step") == 0) {
            if (parse_int(v, 1, &step) != 0)
                return bad_fault(f->spec, "step is not a step (1, 2, ...): ", v);
        } else if (strcmp(kv, "phase") == 0) {
            for (phase = 0; phase < 4 && strcmp(v, phase_names[phase]) != 0; phase++)
                ;
            if (phase == 4)
                return bad_fault(f->spec, "unknown phase ", v);
        } else if (strcmp(kv, "op") == 0) {
            op = v;
        } else if (strcmp(kv, "hold") == 0) {
            long long ms;
            if (parse_int(v, 1, &ms) != 0 || ms > 600000)
                return bad_fault(f->spec, "hold is not a time in ms (1..600000): ", v);
            f->hold_ms = (int)ms;
        } else {
            return bad_fault(f->spec, "unknown key ", kv);
        }
    }
    if (phase == KT__FAULT_BACKWARD && s->p->n_steps == s->p->n_forward)
        return bad_fault(f->spec, "phase backward in a program ", "compiled without training");
    if (phase == KT__FAULT_FORWARD || phase == KT__FAULT_BACKWARD) {
        int32_t count;
        f->at = find_op(s, phase, op, &count);
        if (f->at < 0) {
            char why[96];
            snprintf(why, sizeof why, "the %s runs %d op kernels, none of them ",
                     phase_names[phase], count);
            return bad_fault(f->spec, why, op != NULL ? op : "(the first)");
        }
    }
    int rank_here = s->opt.comm != NULL ? kt_comm_rank(s->opt.comm) : 0;
    if (rank >= 0 && rank != rank_here)
        return KT_OK; /* another rank's fault */
    f->step = step;
    f->phase = phase;
    return KT_OK;
}

void kt__session_fault_arm(kt_session *s, int phase)
{
    kt__fault *f = &s->fault;
    if (f->phase != phase || f->step != s->steps_done + 1)
        return;
    f->phase = -1; /* once */
    if (phase != KT__FAULT_FORWARD && phase != KT__FAULT_BACKWARD)
        return;
    if (f->hold_ms > 0)
        s->hold_at = f->at;
    else
        kt__session_inject_failure(s, f->at);
}

void kt__session_fault_hold(int ms)
{
    struct timespec left = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ; /* a signal handler ran (kt-train's SIGTERM): the hold goes on */
}

/* The optimizer step's and the save's hook: a hold waits, a failure is returned. */
static kt_status fire(kt_session *s, kt_status status)
{
    s->fault.phase = -1; /* once */
    if (s->fault.hold_ms > 0) {
        kt__session_fault_hold(s->fault.hold_ms);
        return KT_OK;
    }
    return kt__error(status, "injected failure (KT_FAULT=\"%s\", a test hook)", s->fault.spec);
}

kt_status kt__session_fault_step(kt_session *s)
{
    if (s->fault.phase != KT__FAULT_STEP || s->fault.step != s->steps_done + 1)
        return KT_OK;
    return fire(s, KT_EINTERNAL);
}

kt_status kt__session_fault_save(kt_session *s)
{
    if (s->fault.phase != KT__FAULT_SAVE || s->steps_done < s->fault.step)
        return KT_OK;
    return fire(s, KT_EIO);
}

kt_status kt__session_fail(kt_session *s, kt_status status, const char *what)
{
    kt_comm *comm = s->opt.comm;
    if (comm == NULL || kt_comm_size(comm) < 2)
        return status;
    if (kt_comm_status(comm) == KT_OK) { /* this rank's own failure: name where */
        long long step = (long long)s->steps_done + 1;
        if (s->failed_at >= 0) {
            const kt__pstep *ps = &s->p->steps[s->failed_at];
            kt__error(status, "step %lld: %s '%s' (%s): %s", step,
                      ps->kind <= KT__STEP_BACKWARD ? kt_op_name(ps->op) : "-",
                      kt__strings_get(&s->p->strings, ps->name),
                      s->exec[s->failed_at].category, s->failed_message);
        } else {
            kt__error_context(status, "step %lld: %s", step, what);
        }
    }
    return kt_comm_abort(comm, status);
}
