/* The compiler's working state, shared by its passes (compile.c drives them). */
#ifndef KT_GRAPH_COMPILER_COMPILER_H
#define KT_GRAPH_COMPILER_COMPILER_H

#include "graph/graph_internal.h"
#include "graph/program_internal.h"

typedef struct kt__cbuf {
    kt_tensor meta;
    int32_t region;
    uint64_t bytes;
    int32_t first, last; /* lifetime, filled by the lifetime pass */
    int32_t storage;     /* the buffer whose memory this one shares (itself if none) */
    int pinned;          /* alive until the end: outputs and the loss */
    int is_input;        /* a graph input: written by the caller, never shared in place */
} kt__cbuf;

typedef struct kt__compiler {
    const kt_graph *g;
    kt_compile_options opt;
    kt__cbuf *bufs;
    int32_t n_bufs, cap_bufs;
    kt__pstep *steps;
    int32_t n_steps, cap_steps, n_forward;
    int32_t *remap;     /* graph value -> canonical value (CSE) */
    char *node_live;    /* graph node kept after CSE and DCE */
    int32_t *value_buf; /* canonical graph value -> buffer id, -1 if none */
    int32_t *grad_buf;  /* graph parameter value -> its KT__REGION_GRAD buffer, or -1 */
    kt__strings strings;
    kt_checkpoint_policy policy;
} kt__compiler;

/* Appends a buffer; *id_out receives its id. */
kt_status kt__compiler_add_buf(kt__compiler *c, const kt_tensor *meta, int32_t region,
                               int32_t *id_out);
/* Appends a step (copied) and gives it a scratch buffer when its kernel needs one. */
kt_status kt__compiler_add_step(kt__compiler *c, const kt__pstep *step);
/* A program string for a graph string offset (-1 stays -1). */
kt_status kt__compiler_name(kt__compiler *c, int32_t graph_name, int32_t *name_out);

/* Passes */
kt_status kt__pass_cse_dce(kt__compiler *c);   /* remap + node_live */
kt_status kt__pass_autodiff(kt__compiler *c);  /* appends the backward schedule */
kt_status kt__pass_lifetimes(kt__compiler *c); /* first/last, pinned, in-place sharing */
/* Activation checkpointing with segments of `group` units (0: none). */
kt_status kt__pass_checkpoint(kt__compiler *c, int32_t group);
/* The group size the policy asks for, given the number of checkpointable units. */
int32_t kt__checkpoint_group_size(const kt__compiler *c, int32_t n_units);
/* Checkpointable units: the graph's checkpoint blocks, or else its live nodes. */
int32_t kt__checkpoint_unit_count(const kt__compiler *c);

#endif
