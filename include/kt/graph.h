/* Building a model as an explicit static graph.
 *
 * A graph holds inputs (data fed at run time), parameters (trained or frozen weights) and op
 * nodes from the op table (kt/ops.h). Every call validates shapes and dtypes at once and
 * returns a value handle; a bad build is reported with a message naming the node. The graph
 * is then compiled into a program (kt/program.h): autodiff, passes and the memory plan.
 *
 *     kt_graph *g;  kt_value x, w, y, loss;
 *     kt_graph_create(&g);
 *     kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){32, 64}, &x);
 *     kt_graph_param(g, "w", KT_F32, 2, (int64_t[]){64, 10}, kt_init_normal(0.02f), &w);
 *     kt_graph_op(g, "logits", KT_OP_MATMUL, NULL, (kt_value[]){x, w}, 2, &y);
 *     ...
 *     kt_graph_set_loss(g, loss);
 */
#ifndef KT_GRAPH_H
#define KT_GRAPH_H

#include <stdint.h>

#include "ops.h"
#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_graph kt_graph;

/* A value in a graph: an input, a parameter or an op output. */
typedef struct kt_value {
    int32_t id;
} kt_value;

typedef enum kt_init_kind {
    KT_INIT_ZEROS = 0,
    KT_INIT_ONES = 1,
    KT_INIT_NORMAL = 2,  /* mean 0, standard deviation a */
    KT_INIT_UNIFORM = 3, /* in [a, b) */
    KT_INIT_LOADED = 4   /* left to the caller (weights loaded from a file) */
} kt_init_kind;

typedef struct kt_init {
    kt_init_kind kind;
    float a, b;
} kt_init;

/* (initialised variables, not compound literals: C++ has none, and the header is for both) */
static inline kt_init kt_init_zeros(void)
{
    kt_init r = {KT_INIT_ZEROS, 0.0f, 0.0f};
    return r;
}
static inline kt_init kt_init_normal(float std)
{
    kt_init r = {KT_INIT_NORMAL, std, 0.0f};
    return r;
}
static inline kt_init kt_init_uniform(float lo, float hi)
{
    kt_init r = {KT_INIT_UNIFORM, lo, hi};
    return r;
}

/* Lifetime: a graph is needed only until kt_compile returns; the program holds nothing of it.
 * On failure *graph_out is NULL (kt_ktg_parse too). */
kt_status kt_graph_create(kt_graph **graph_out);
void kt_graph_destroy(kt_graph *graph);

/* Names are unique among inputs and parameters (and among outputs); at most 127 bytes. */
kt_status kt_graph_input(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                         const int64_t *shape, kt_value *value_out);
/* A trainable parameter (f32, so that it can be its own master copy). */
kt_status kt_graph_param(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                         const int64_t *shape, kt_init init, kt_value *value_out);
/* A parameter that is never trained (any dtype; e.g. frozen bf16 weights). */
kt_status kt_graph_const_param(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                               const int64_t *shape, kt_init init, kt_value *value_out);

/* Adds an op node; outs receives the op's outputs (kt_op_arity's n_out of them). name may be
 * NULL (the node is then called "<op>#<index>" in messages). */
kt_status kt_graph_op(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs,
                      const kt_value *in, int n_in, kt_value *outs);

/* Marks a value as an output the caller reads after forward (kept alive, never overwritten). */
kt_status kt_graph_output(kt_graph *g, kt_value v, const char *name);
/* Marks the scalar f32 loss that backward differentiates. */
kt_status kt_graph_set_loss(kt_graph *g, kt_value v);

/* ---- annotations for later passes -------------------------------------------------------- */

/* Activation checkpointing (the checkpoint pass): nodes added between begin and end form
 * one recompute segment. Segments do not nest. */
kt_status kt_graph_checkpoint_begin(kt_graph *g);
kt_status kt_graph_checkpoint_end(kt_graph *g);

typedef enum kt_checkpoint_policy_kind {
    KT_CHECKPOINT_NONE = 0,
    KT_CHECKPOINT_SEGMENTS = 1, /* the explicit segments */
    KT_CHECKPOINT_EVERY_K = 2,  /* every k layers */
    KT_CHECKPOINT_SQRTN = 3,    /* sqrt(n) segments (Chen et al. 2016) */
    KT_CHECKPOINT_BUDGET = 4    /* segments chosen so the planned peak fits a byte budget */
} kt_checkpoint_policy_kind;

typedef struct kt_checkpoint_policy {
    kt_checkpoint_policy_kind kind;
    int64_t k;            /* EVERY_K */
    uint64_t budget_bytes; /* BUDGET */
} kt_checkpoint_policy;

/* The graph's policy (kt_compile_options.checkpoint can override it). A graph with segments
 * and no policy set compiles as SEGMENTS; an explicit NONE leaves its segments inert. */
kt_status kt_graph_set_checkpoint_policy(kt_graph *g, const kt_checkpoint_policy *policy);

/* The save-list: the node computing v keeps its outputs under checkpointing (never
 * recomputed, never overwritten in place). Ops the op table marks must-save (topk_router,
 * the MoE layer) are on it by default. */
kt_status kt_graph_mark_save(kt_graph *g, kt_value v);

/* Context parallelism: dimension `dim` of this input is split over the CP ranks. */
kt_status kt_graph_shard_input(kt_graph *g, kt_value input, int dim);

/* ---- the model-description language (docs/ktg.md) ----------------------------------------- */

typedef struct kt_ktg_define {
    const char *name; /* a `const` of the file */
    int64_t value;
} kt_ktg_define;

/* Parses a .ktg text into a new graph. `filename` is used in messages. `defines` override
 * the file's constants (an override naming no constant is an error). On failure nothing is
 * returned in graph_out, every diagnostic ("file:line:col: error: ...", the source line and
 * a caret) is written to diag (NUL-terminated, cut at diag_size; diag may be NULL), the count
 * goes to n_errors_out (may be NULL), the first diagnostic is the last error, and the status
 * is KT_EFORMAT (syntax, names) or KT_EINVAL (shapes and dtypes rejected by the graph). */
kt_status kt_ktg_parse(const char *text, size_t len, const char *filename,
                       const kt_ktg_define *defines, int n_defines, kt_graph **graph_out,
                       char *diag, size_t diag_size, int *n_errors_out);

/* The dtype and shape of a value (data NULL). */
kt_status kt_graph_value_meta(const kt_graph *g, kt_value v, kt_tensor *meta_out);
int kt_graph_node_count(const kt_graph *g);
/* 1 when kt_graph_set_loss was called. */
int kt_graph_has_loss(const kt_graph *g);

#ifdef __cplusplus
}
#endif
#endif
