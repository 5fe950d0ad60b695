/* TEMPORARY placeholder: being written. */
#include "ops/op_util.h"
#include "ops/op_desc.h"
static kt_status todo_infer(const kt_op_attrs *a, const kt_tensor *in, int n, kt_tensor *out) { (void)a; (void)in; (void)n; (void)out; return kt__error(KT_EUNSUPPORTED, "not yet"); }
static kt_status todo_kernel(const kt__op_call *c) { (void)c; return KT_EUNSUPPORTED; }
const kt__op_desc kt__op_softmax = {.name = "softmax", .min_in = 1, .max_in = 8, .n_out = 1, .infer = todo_infer, .forward = todo_kernel, .backward = todo_kernel};
const kt__op_desc kt__op_log_softmax = {.name = "log_softmax", .min_in = 1, .max_in = 8, .n_out = 1, .infer = todo_infer, .forward = todo_kernel, .backward = todo_kernel};
