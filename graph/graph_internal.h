/* The graph under construction (the compiler half's input). Values and nodes live in
 * growable arrays owned by the graph; names live in the graph's string pool. */
#ifndef KT_GRAPH_GRAPH_INTERNAL_H
#define KT_GRAPH_GRAPH_INTERNAL_H

#include "graph/strings.h"
#include "kt/graph.h"

typedef enum kt__value_kind {
    KT__VALUE_INPUT = 0,
    KT__VALUE_PARAM = 1,       /* trainable */
    KT__VALUE_CONST_PARAM = 2, /* never trained */
    KT__VALUE_NODE = 3         /* an op output */
} kt__value_kind;

typedef struct kt__gvalue {
    kt_tensor meta; /* dtype and shape; data NULL */
    kt__value_kind kind;
    int32_t name;   /* string pool offset; -1 for node outputs */
    int32_t node;   /* producing node (KT__VALUE_NODE), else -1 */
    int32_t out_index;
    kt_init init;
} kt__gvalue;

typedef struct kt__gnode {
    kt_op op;
    kt_op_attrs attrs;
    int32_t n_in, n_out;
    int32_t in[KT_OP_MAX_IN];
    int32_t out[KT_OP_MAX_OUT];
    int32_t name; /* string pool offset; -1: unnamed */
    int must_save; /* on the save-list (kt_graph_mark_save) */
} kt__gnode;

/* A recompute segment: nodes [first, last). */
typedef struct kt__gsegment {
    int32_t first, last;
} kt__gsegment;

typedef struct kt__goutput {
    int32_t value;
    int32_t name;
} kt__goutput;

struct kt_graph {
    kt__gvalue *values;
    int32_t n_values, cap_values;
    kt__gnode *nodes;
    int32_t n_nodes, cap_nodes;
    kt__goutput *outputs;
    int32_t n_outputs, cap_outputs;
    int32_t loss; /* value id or -1 */
    kt__strings strings;
    kt__gsegment *segments;
    int32_t n_segments, cap_segments;
    int32_t open_segment; /* first node of the segment being built, or -1 */
    kt_checkpoint_policy policy;
    int policy_set; /* kt_graph_set_checkpoint_policy was called (an explicit NONE included) */
    int32_t *shard_dim;   /* per value: the sharded dimension of an input, or -1 */
    int32_t cap_shard;
};

/* Grows *array (elements of elem bytes, capacity *cap, doubling from 64) to hold one more
 * than count; `what` names the owner in the error ("graph", "compile", ...). */
kt_status kt__grow_array(void **array, int32_t *cap, int32_t count, size_t elem,
                         const char *what);

#endif
