/* kt-run's MoE part: the CPU MoE layers a program's moe ops run, their experts from --params
 * and their gradients in --out. Each function prints "kt-run: ..." when it fails and returns
 * nonzero. */
#ifndef KT_RUN_MOE_H
#define KT_RUN_MOE_H

#include "kt/kt.h"

typedef struct run_moe_args {
    kt_dtype dtype;    /* --moe-dtype */
    kt_moe_mode mode;  /* --moe-mode */
    int64_t inter;     /* --moe-inter (0: not given) */
    int64_t lora_rank; /* --lora-rank */
    float lora_alpha;  /* --lora-alpha */
} run_moe_args;

/* One layer per moe op (kt_moe_layers_create); a --moe-inter that contradicts an op's own
 * intermediate size is refused. */
int run_moe_create(const kt_program *p, const run_moe_args *a, kt_threadpool *pool,
                   kt_moe_layers *m);
/* Before kt_session_load: the experts must be in the parameters file (params; NULL: there is
 * none), and in LoRA mode their adapters too, unless allow_missing (then they keep their
 * initial values: the experts drawn from seed 0, the adapters as kt_moe_create starts them). */
int run_moe_check_params(const kt_program *p, const kt_moe_layers *m, const char *params,
                         int allow_missing);
/* "grad.<name>" for every expert weight (full mode) or LoRA adapter (LoRA mode) of every moe
 * op, under the op's names: add(ctx, name, gradient) for each. */
int run_moe_gradients(const kt_program *p, const kt_moe_layers *m,
                      int (*add)(void *ctx, const char *name, const kt_tensor *t), void *ctx);

#endif
