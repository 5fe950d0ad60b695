/* Checking an op against a float64 reference.
 *
 * gc_check runs the op's forward and backward kernels (f32), runs the test's float64
 * reference forward on the same inputs, and compares:
 *   - every output with the reference (relative to the output's scale, fwd_tol);
 *   - every input gradient with central finite differences of the float64 reference
 *     applied to L = sum(grad_out * out), relative to the gradient's scale (grad_tol).
 * Because the reference is float64, the finite differences are accurate to ~1e-9 and any
 * mismatch is the kernel's error. Integer inputs (ids, targets) get no gradient, nor do the
 * float inputs the op's row marks as taking none (topk_router's selection-only bias). */
#ifndef KT_TEST_GRADCHECK_H
#define KT_TEST_GRADCHECK_H

#include "tests/support/test_util.h"

/* A float64 tensor for references: row-major, contiguous. */
typedef struct gc_dt {
    double *d;
    int ndim;
    int64_t shape[KT_MAX_DIMS];
    int64_t n;
} gc_dt;

/* The reference forward: in[] are the op's inputs as doubles (integer inputs converted
 * exactly), out[] are allocated with the inferred output shapes; fill them. */
typedef void (*gc_ref_fn)(const kt_op_attrs *attrs, const gc_dt *in, int n_in, gc_dt *out,
                          int n_out);

typedef struct gc_case {
    kt_op op;
    kt_op_attrs attrs;
    const kt_tensor *in; /* f32 float inputs, i32/i64 index inputs */
    int n_in;
    gc_ref_fn ref;
    double fwd_tol;  /* default 1e-5 */
    double grad_tol; /* default 1e-4 */
    int probes;      /* elements checked per input by finite differences; 0: all */
    int threads;     /* thread-pool size; 0: no pool */
    uint64_t seed;   /* for grad_out and the probe choice */
} gc_case;

void gc_check(const gc_case *c);

/* Runs the op on inputs converted to `dtype` (bf16/f16) and compares outputs and input
 * gradients with the f32 run, within `tol` relative to each tensor's scale. */
void gc_check_lowp(const gc_case *c, kt_dtype dtype, double tol);

/* Forward + backward twice with the same thread count: bitwise identical results. */
void gc_check_deterministic(const gc_case *c, int threads);
/* The same with t1 and with t2 threads (0: no pool), for kernels whose partition does not
 * change their summation order. */
void gc_check_thread_invariant(const gc_case *c, int t1, int t2);

#endif
