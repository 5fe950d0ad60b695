/* The session: a program bound to memory and a thread pool, ready to run. */
#ifndef KT_GRAPH_RUNTIME_SESSION_INTERNAL_H
#define KT_GRAPH_RUNTIME_SESSION_INTERNAL_H

#include "graph/program_internal.h"
#include "ops/op_desc.h"

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
    void **comm_scratch; /* per step: message buffers for this world size, or NULL */
    /* the bound MoE layers' trainable values (LoRA adapters, f32 expert weights), which the
     * optimizer step updates with the graph's parameters */
    struct kt__moe_train *moe_train;
    int n_moe_train;
    int has_moe_ops; /* the program runs MoE layers (every rank knows: the same program) */
};

typedef struct kt__moe_train {
    float *param, *grad, *state[2];
    int64_t n;
    int binding; /* the layer's index in kt_session_options.moe_layers */
} kt__moe_train;

/* Tests: makes step `step` (one that runs an op kernel) fail the next time it runs. */
kt_status kt__session_inject_failure(kt_session *s, int32_t step);

/* Runs steps [begin, end); on failure names the step in the message. */
kt_status kt__session_run(kt_session *s, int32_t begin, int32_t end);
/* Appends a trace event if tracing is on. */
void kt__session_trace(kt_session *s, const char *name, const char *category, uint64_t t0,
                       uint64_t t1, int32_t step);
uint64_t kt__now_ns(void);

#endif
