/* The session: a program bound to memory and a thread pool, ready to run. */
#ifndef KT_GRAPH_RUNTIME_SESSION_INTERNAL_H
#define KT_GRAPH_RUNTIME_SESSION_INTERNAL_H

#include "graph/program_internal.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"

/* KT_FAULT, the fault-injection test hook (session_fault.c). */
enum { KT__FAULT_FORWARD = 0, KT__FAULT_BACKWARD = 1, KT__FAULT_STEP = 2, KT__FAULT_SAVE = 3 };
typedef struct kt__fault {
    int phase;    /* KT__FAULT_*, or -1: none here (or it has fired) */
    int64_t step; /* the training step it fires in (steps_done + 1) */
    int32_t at;   /* forward / backward: the program step whose kernel fails */
    int hold_ms;  /* > 0: instead of failing, wait this long first (a slow or hung rank) */
    char spec[128];
} kt__fault;

/* One step, prepared at session creation so that running it is a function-pointer call. */
typedef struct kt__exec_step {
    kt__op_kernel_fn kernel; /* forward or backward kernel; NULL for fill / accumulate */
    kt__op_call call;
    const char *category;
} kt__exec_step;

struct kt_session {
    const kt_program *p;
    kt_session_options opt;
    kt_threadpool *pool;
    int own_pool;
    unsigned char *region[KT__REGION_COUNT];
    float *opt_state[2]; /* SGD momentum / AdamW m and v, laid out like the gradient region */
    kt_tensor *tensors;  /* one per buffer, data bound */
    kt_tensor *call_tensors;
    kt__exec_step *exec;
    int micro;           /* backward passes accumulated since the last step */
    int forward_ok;      /* the last forward completed */
    int64_t steps_done;
    float loss, grad_norm, lr;
    size_t trace_count;
    int32_t inject_at; /* tests: the step that fails next (once), or -1 */
    kt__op_kernel_fn injected_kernel; /* its own kernel, restored when it has failed */
    kt__fault fault;
    int32_t hold_at; /* KT_FAULT hold: the program step that waits before it runs, or -1 */
    int32_t failed_at; /* the program step the last run failed in, or -1 */
    char failed_message[1024]; /* its message, before the step's context was added */
    void **comm_scratch; /* per step: message buffers for this world size, or NULL */
    /* the ops with lifecycle hooks (ops/op_state.h) that have state in this session, in op
     * table order: the only ones the per-step hooks are called for */
    struct kt__stateful *stateful;
    int n_stateful;
    void **bindings; /* the session's copy of the options' array (the caller's may go) */
};

/* A trainable span of a stateful op with the optimizer state the session keeps for it. */
typedef struct kt__state_span {
    float *param, *grad, *state[2];
    int64_t n;
    const char *name; /* the op's: optimizer state is saved as "<prefix><name>" */
} kt__state_span;

typedef struct kt__stateful {
    kt_op op;
    const struct kt__op_state *hooks;
    void *state;          /* what its bind made */
    struct kt__op_node *nodes; /* its forward steps */
    int n_nodes;          /* the program runs it (every rank knows: the same program) */
    kt__state_span *spans;
    int n_spans;
} kt__stateful;

/* Binds every op with hooks (session_state.c): checks, state, spans and their optimizer
 * state; kt__session_unbind_state undoes it (safe on a partial bind). */
kt_status kt__session_bind_state(kt_session *s);
void kt__session_unbind_state(kt_session *s);
/* The optimizer state bytes the stateful ops' spans would need under these options. */
kt_status kt__session_state_bytes(const kt_program *p, const kt_session_options *o, int states,
                                  uint64_t *bytes_out);
/* The objects the options bind to stateful ops (kt_session_options' layers), and their count. */
void *const *kt__session_bindings(const kt_session_options *o, int *n_out);
/* Copies the options' binding array into the session (and points the options at the copy);
 * kt__session_drop_bindings frees it. */
kt_status kt__session_keep_bindings(kt_session *s);
void kt__session_drop_bindings(kt_session *s);
/* The optimizer's state tensors per trainable value. */
int kt__optimizer_states(const kt_optimizer_config *o);

/* Tests: makes step `step` (one that runs an op kernel) fail the next time it runs. */
kt_status kt__session_inject_failure(kt_session *s, int32_t step);

/* KT_FAULT: parsed at creation (a malformed one is refused, naming it); armed at the start
 * of each forward / backward; the optimizer step's check (an error when it fires). */
kt_status kt__session_fault_parse(kt_session *s);
void kt__session_fault_arm(kt_session *s, int phase);
kt_status kt__session_fault_step(kt_session *s);
kt_status kt__session_fault_save(kt_session *s);
/* KT_FAULT hold: the calling thread waits ms milliseconds. */
void kt__session_fault_hold(int ms);
/* A failed forward, backward or optimizer step of a session with several ranks: the
 * message gets the training step and the op (what: the part, when no op failed), and
 * kt_comm_abort tells the other ranks. Returns the root cause every rank reports. With one
 * rank: status, the message as it was. */
kt_status kt__session_fail(kt_session *s, kt_status status, const char *what);

/* Runs steps [begin, end); on failure names the step in the message. */
kt_status kt__session_run(kt_session *s, int32_t begin, int32_t end);
/* Appends a trace event if tracing is on. */
void kt__session_trace(kt_session *s, const char *name, const char *category, uint64_t t0,
                       uint64_t t1, int32_t step);
uint64_t kt__now_ns(void);

#endif
