/* rope's internals, shared by its kernels (rope.c), its session hooks (rope_state.c) and its
 * tests: the frequencies an attribute set gives, the cos/sin of one position, and the table
 * of them that a session builds once per distinct attribute set. */
#ifndef KT_OPS_ROPE_H
#define KT_OPS_ROPE_H

#include <stdint.h>

#include "kt/ops.h"

/* The most elements of a head that rotate: a row's rotated part is held whole on the stack,
 * since the deinterleaving layout permutes it and so cannot be streamed in place. */
#define KT__ROPE_MAX_ROTARY 1024

/* What the angles depend on: the attributes that shape them, with rotary_dim resolved
 * against the head dim, and zero where the scaling ignores a field. Nodes with equal keys
 * (compared bytewise: build it with kt__rope_key_of) share a table. */
typedef struct kt__rope_key {
    int64_t max_positions, original_max_positions;
    int32_t rotary_dim, scaling, truncate;
    float theta, factor, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor;
} kt__rope_key;

/* The frequencies of a key: pair j turns by position * inv_freq[j], and cos and sin are
 * multiplied by attn (YaRN's attention factor; 1 otherwise). */
typedef struct kt__rope_freqs {
    int half; /* pairs: rotary_dim / 2 */
    double attn;
    double inv_freq[KT__ROPE_MAX_ROTARY / 2];
} kt__rope_freqs;

/* The key of checked attributes for heads of d elements. */
kt__rope_key kt__rope_key_of(const kt_op_attrs *a, int64_t d);
void kt__rope_freqs_of(const kt__rope_key *k, kt__rope_freqs *f);
/* cos and sin (f->half of each) of position pos: the one function that fills a session's
 * table and that a direct call computes with, so both paths agree bit for bit. */
void kt__rope_angles(const kt__rope_freqs *f, int64_t pos, float *cos_out, float *sin_out);

/* A session's table for one key: row p holds the cos (and sin) of position p. */
typedef struct kt__rope_table {
    kt__rope_key key;
    int half;
    float *cos, *sin; /* [max_positions, half] each */
} kt__rope_table;

/* What rope's bind makes (kt__op_call.state of its kernels in a session). */
typedef struct kt__rope_tables {
    int n_tables;
    kt__rope_table *tables;
} kt__rope_tables;

/* The table of key k, or NULL (no state: a direct call). */
const kt__rope_table *kt__rope_find(const kt__rope_tables *s, const kt__rope_key *k);

extern const struct kt__op_state kt__rope_state;

#endif
