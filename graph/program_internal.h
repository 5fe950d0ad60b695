/* The compiled program, shared by the compiler half (which builds it) and the runtime half
 * (which loads, validates and runs it). Everything is plain arrays of plain structs, so a
 * .ktp file is these arrays written out field by field. */
#ifndef KT_GRAPH_PROGRAM_INTERNAL_H
#define KT_GRAPH_PROGRAM_INTERNAL_H

#include <stdatomic.h>

#include "graph/strings.h"
#include "kt/program.h"

/* Where a buffer lives. The activation region is planned (buffers share memory over time);
 * the others hold one buffer each for the session's whole life. */
typedef enum kt__region {
    KT__REGION_ACT = 0,   /* inputs, activations, gradients, scratch: the planned arena */
    KT__REGION_PARAM = 1, /* parameters */
    KT__REGION_GRAD = 2,  /* accumulated gradients of trainable parameters (f32) */
    KT__REGION_COUNT = 3
} kt__region;

typedef struct kt__pbuf {
    kt_tensor meta;  /* dtype and shape, data NULL; scratch buffers are u8-sized as i32 */
    int32_t region;  /* kt__region */
    uint64_t offset; /* within the region, 64-byte aligned */
    uint64_t bytes;
    int32_t first, last; /* lifetime in steps (activation region); -1 elsewhere */
    int32_t storage;     /* in-place sharing: the buffer whose memory this one reuses (itself
                          * if none); shared buffers have one offset and one joint lifetime */
} kt__pbuf;

typedef enum kt__step_kind {
    KT__STEP_FORWARD = 0,    /* the op's forward kernel: in -> out */
    KT__STEP_BACKWARD = 1,   /* the op's backward kernel: in, out, gout -> gin */
    KT__STEP_FILL = 2,       /* out[0] = attrs.alpha everywhere (gradient seeds, zeros) */
    KT__STEP_ACCUM_GRAD = 3, /* parameter gradient: in[0] copied (first micro-batch) or added
                              * into out[0] (a KT__REGION_GRAD buffer) */
    KT__STEP_KIND_COUNT = 4
} kt__step_kind;

typedef struct kt__pstep {
    int32_t kind; /* kt__step_kind */
    kt_op op;
    kt_op_attrs attrs;
    int32_t n_in, n_out;
    int32_t in[KT_OP_MAX_IN];   /* buffer ids */
    int32_t out[KT_OP_MAX_OUT];
    int32_t gout[KT_OP_MAX_OUT]; /* backward: -1 = no gradient (integer outputs) */
    int32_t gin[KT_OP_MAX_IN];   /* backward: -1 = not wanted */
    int32_t scratch;             /* buffer id or -1 */
    int32_t name;                /* node name (string offset) or -1 */
    int32_t flags;               /* KT__STEP_RECOMPUTE, KT__STEP_STATE_RECOMPUTES */
    int32_t node;                /* compile time only: the graph node (-1: none); not saved */
    double flops;
} kt__pstep;

/* A forward step cloned into the backward schedule by the checkpoint pass. */
#define KT__STEP_RECOMPUTE 1
/* A forward step of the forward schedule, inside a recomputed segment, of a stateful op whose
 * hooks ask for it (kt__op_state.state_recompute): whoever creates the op's state keeps no
 * intermediates for it and recomputes them in backward. */
#define KT__STEP_STATE_RECOMPUTES 2

/* An input, parameter or output: a named buffer. */
typedef struct kt__pentry {
    int32_t name;
    int32_t buf;
    int32_t grad_buf; /* parameters: the KT__REGION_GRAD buffer, or -1 (frozen) */
    kt_init init;
    int32_t shard_dim; /* inputs: the dimension split over context-parallel ranks, or -1 */
} kt__pentry;

struct kt_program {
    kt__pbuf *bufs;
    int32_t n_bufs;
    kt__pstep *steps;
    int32_t n_steps, n_forward; /* steps [0, n_forward) are the forward schedule */
    kt__pentry *entries[3];     /* inputs, params, outputs (by kt_tensor_role) */
    int32_t n_entries[3];
    int32_t loss_buf;           /* -1 when there is no loss */
    uint64_t region_bytes[KT__REGION_COUNT];
    uint64_t lower_bound;
    kt__strings strings;
    /* References beyond the creator's (0 when made): each session holds one, so that
     * kt_program_destroy before kt_session_destroy is safe; the last release frees it. */
    atomic_int extra_refs;
};

/* A session's reference (kt_session_create / kt_session_destroy). */
void kt__program_retain(const kt_program *p);
void kt__program_release(const kt_program *p);

/* Frees a program's arrays (safe on a partly built program). */
void kt__program_free(kt_program *p);

/* Checks a program completely: indices, regions, sizes, every step's shapes against shape
 * inference, scratch sizes, and that no two live activation buffers overlap. The loader
 * runs it on every file; the compiler runs it on every plan. */
kt_status kt__program_validate(const kt_program *p);

/* The data-flow part of kt__program_validate (program_check_flow.c): one writer per buffer
 * in its region, reads only of what was written before, outputs and the loss computed in the
 * forward schedule. */
kt_status kt__program_check_flow(const kt_program *p);

/* The memory part of kt__program_validate (program_check_memory.c), run after the tables,
 * steps and data flow have been checked: inputs, outputs and the loss alive whenever the caller may
 * touch them and in memory of their own, in-place sharing as the compiler chains it, no two
 * live activations or any two parameters or gradients overlapping, region sizes and the
 * lower bound as the buffers give them. */
kt_status kt__program_check_memory(const kt_program *p);

/* "buffer 4", or "buffer 0 (input 'x')" when an entry names it, into text (for messages). */
const char *kt__program_buf_label(const kt_program *p, int32_t b, char *text, size_t cap);
/* "step 3 (fill)", "step 0 (forward matmul 'fc1')", into text */
const char *kt__program_step_label(const kt_program *p, int32_t at, char *text, size_t cap);

/* Bytes a scratch buffer of `bytes` is described by: an i32 tensor of ceil(bytes/4). */
void kt__scratch_meta(kt_tensor *meta, uint64_t bytes);

#endif
