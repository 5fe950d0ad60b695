/* The op table entry: everything the graph, the planner and the executor need to know about
 * an op, in one row per op. Each op family's file defines its rows as
 * `const kt__op_desc kt__op_<name>`; op_table.c collects them through KT_OP_LIST. */
#ifndef KT_OPS_OP_DESC_H
#define KT_OPS_OP_DESC_H

#include <stddef.h>

#include "kt/ops.h"
#include "lib/ops/attrs.h"

/* One kernel invocation. Forward reads in[] and writes out[]. Backward reads in[], out[]
 * and gout[] (gradients of the outputs) and writes the gin[] entries whose data is not
 * NULL. Shapes and dtypes were validated before the kernel runs. */
typedef struct kt__op_call {
    const kt_op_attrs *attrs;
    const kt_tensor *in;
    int n_in;
    const kt_tensor *out;
    kt_tensor *out_w; /* forward: the same tensors as out, writable */
    int n_out;
    const kt_tensor *gout;
    kt_tensor *gin;
    kt_threadpool *pool;
    void *scratch;
    size_t scratch_bytes;
    /* Objects the session binds to ops that keep state outside the graph (MoE layers). */
    void *const *bindings;
    int n_bindings;
    /* The session's communicator (NULL: one rank) and the step's buffer for messages, of
     * the op's comm_scratch bytes for this world size. */
    struct kt_comm *comm;
    void *comm_scratch;
    size_t comm_scratch_bytes;
    void *state; /* stateful ops: what the op's bind made for this session */
} kt__op_call;

typedef kt_status (*kt__op_infer_fn)(const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                                     kt_tensor *out);
typedef size_t (*kt__op_scratch_fn)(const kt_op_attrs *attrs, const kt_tensor *in, int n_in);
typedef double (*kt__op_flops_fn)(const kt_op_attrs *attrs, const kt_tensor *in, int n_in);
typedef kt_status (*kt__op_kernel_fn)(const kt__op_call *call);
/* Message buffers an op needs for a given world size (known only when a session runs). */
typedef size_t (*kt__op_comm_scratch_fn)(const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                                         int world);

typedef struct kt__op_desc {
    const char *name;
    int min_in, max_in, n_out;
    /* Bit i set: output 0 may share memory with input i (the kernel reads each element
     * before writing it). The planner uses this only when input i is dead afterwards. */
    unsigned inplace_in;
    /* What the backward kernel reads: bit i of bwd_reads_in = input i, of bwd_reads_out =
     * output i. The planner keeps exactly these alive from forward to backward. */
    unsigned bwd_reads_in, bwd_reads_out;
    /* Inputs that never receive a gradient (integer ids, targets). */
    unsigned no_grad_in;
    /* Outputs kept rather than recomputed under activation checkpointing: recomputing the
     * op costs far more than keeping them (the router's choices, the CPU experts' output). */
    int must_save;
    kt__op_infer_fn infer;
    kt__op_scratch_fn scratch_fwd, scratch_bwd; /* NULL: none */
    kt__op_flops_fn flops;                      /* NULL: 0 */
    kt__op_comm_scratch_fn comm_scratch;        /* NULL: none */
    kt__op_kernel_fn forward, backward;
    /* The op's attributes (attrs.h): defaults, checks, .ktg, CSE, .ktp and docs read them. */
    const kt__attr_desc *attrs;
    int n_attrs;
    const struct kt__op_state *state; /* lifecycle hooks (ops/op_state.h); NULL: stateless */
} kt__op_desc;

#define KT__OP_DECLARE(upper, lower) extern const kt__op_desc kt__op_##lower;
KT_OP_LIST(KT__OP_DECLARE)
#undef KT__OP_DECLARE

/* The row for op, or NULL for an invalid op. */
const kt__op_desc *kt__op_get(kt_op op);
/* The row KT_OP_LIST gave op, ignoring test overrides: for what must not change while a test
 * swaps a row in (the .ktp attribute record's layout). */
const kt__op_desc *kt__op_get_builtin(kt_op op);
/* Tests: op's row is `row` until set back to NULL, so a test op runs through the whole stack
 * without the public op list carrying it. Not thread-safe; nothing else calls it. */
void kt__op_override_for_test(kt_op op, const kt__op_desc *row);

#endif
