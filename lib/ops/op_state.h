/* Lifecycle hooks of stateful ops: ops that keep state outside the graph's memory plan (the
 * MoE layer's experts and caches, a KV cache, a running statistic). A row of the op table
 * points to one kt__op_state; the session calls its hooks at fixed points of its life and of
 * each step, for the ops that have them only, and names no op itself. TFLM's registration
 * (init / prepare / invoke / free) is the model. Every hook but bind may be NULL. */
#ifndef KT_OPS_OP_STATE_H
#define KT_OPS_OP_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "kt/io.h"
#include "kt/ops.h"

struct kt_comm;

/* One node of the op in the session's program: its step of the forward schedule. */
typedef struct kt__op_node {
    int32_t step;
    const char *name; /* "" when unnamed */
    const kt_op_attrs *attrs;
    kt_tensor in[KT_OP_MAX_IN]; /* dtypes and shapes, data NULL */
    int n_in;
} kt__op_node;

/* What bind sees: the op's nodes and what the session's options give stateful ops. */
typedef struct kt__op_bind {
    const kt__op_node *nodes; /* schedule order; valid for the session's life */
    int n_nodes;
    void *const *bindings; /* kt_session_options.moe_layers: objects the caller made */
    int n_bindings;
    struct kt_comm *comm; /* NULL: one rank */
    int moe_parallel;     /* kt_session_options.moe_parallel (kt_moe_parallel_choice) */
} kt__op_bind;

/* A flat array of f32 values the op trains itself, with its gradient. The session
 * averages, measures, clips and updates it with the graph's parameters, keeps its optimizer
 * state and saves that as "<optimizer prefix><name>". */
typedef struct kt__op_span {
    float *param, *grad;
    int64_t n;
    const char *name;
} kt__op_span;

typedef struct kt__op_state {
    /* The checkpoint pass marks this op's forward steps inside recomputed segments
     * KT__STEP_STATE_RECOMPUTES, meaning: whoever creates its state keeps no intermediates
     * there and recomputes them in backward. 0: the flag is invalid on this op. */
    int state_recompute;
    /* The trainables are split over the ranks (rank 0 holding all of them, or each rank its
     * share): their part of the gradient norm is summed over the ranks, every rank joining the
     * collective when the program has the op's nodes. */
    int spans_sharded;

    /* Session creation: checks the nodes against b, makes the per-session state (handed to
     * every other hook and to the op's kernels as kt__op_call.state). *state_out NULL: the
     * session has nothing of this op (allowed only when b->n_nodes is 0). */
    kt_status (*bind)(const kt__op_bind *b, void **state_out);
    void (*unbind)(void *state);
    /* f32 values of its spans a bind would give (the memory a session needs, before one
     * exists). */
    int64_t (*span_floats)(const kt__op_bind *b);
    /* Writes up to cap spans into out (out NULL: counts); returns how many there are. */
    int (*spans)(void *state, kt__op_span *out, int cap);

    /* Steps. forward_begin recovers from an earlier poison: with report, returns the failure
     * that poisoned it (once, then the state is usable again); without, only clears it. */
    kt_status (*forward_begin)(void *state, int report);
    void (*backward_begin)(void *state); /* first micro-batch of an accumulation */
    void (*backward_end)(void *state);   /* a backward completed */
    void (*poison)(void *state);         /* a forward or backward step failed */

    /* The session's one safetensors file. save_count: items and bytes of names save_items
     * writes (names into `names`). meta_key with save_meta's value (empty: none). */
    size_t (*save_count)(void *state, size_t *name_bytes);
    kt_status (*save_items)(void *state, kt_st_item *items, char *names);
    const char *meta_key;
    kt_status (*save_meta)(void *state, char *value, size_t cap);
    /* Load: whether the file holds this op's state (else it is left as it is); then a check
     * of everything (dry_run) before anything is copied; knows: whether a tensor name of the
     * file (optimizer prefix removed; is_state: it had one) is this op's. */
    int (*file_holds)(void *state, const kt_st_file *f);
    kt_status (*load)(void *state, const kt_st_file *f, int dry_run, const char *path);
    int (*knows)(void *state, const char *name, int is_state);
} kt__op_state;

#endif
