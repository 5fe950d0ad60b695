/* kt-bench train: one model, batch and optimizer trained by libkt and by PyTorch
 * (transformers, PEFT) in the same run on the same threads; the parts, one file per job:
 *
 *   bench_train.c       options, the two configurations, the report
 *   train_libkt.c       libkt's training loop, run in a forked child (the public API only)
 *   train_checkpoint.c  the LoRA configuration's random checkpoint (bf16): a Qwen3-MoE, or a
 *                       DeepSeek-V2 (MLA, shared experts, a first dense layer)
 *   train_proc.c        the child processes and their peak RSS
 *   train_torch_peer.py the PyTorch side */
#ifndef KT_BENCH_TRAIN_H
#define KT_BENCH_TRAIN_H

#include <stdint.h>

#include <kt/kt.h>

/* A Qwen3-MoE model's sizes, as transformers' config names them, and the step's batch;
 * deepseek_v2: a DeepSeek-V2 (no q LoRA) whose extra sizes follow. */
typedef struct train_shape {
    int64_t vocab, hidden, heads, kv_heads, head_dim, experts, top_k, inter, layers;
    int64_t batch, seq;
    double rope_theta;
    int norm_topk; /* the router renormalises its top-k weights */
    double aux_coef; /* the load-balancing loss's weight; 0: none */
    int deepseek_v2;
    int64_t kv_lora, qk_nope, qk_rope, v_head; /* MLA */
    int64_t shared, first_dense, dense_inter;  /* shared experts; leading dense layers */
} train_shape;

/* What the libkt child trains: a program (made before the fork), its MoE layers, and the
 * checkpoint it starts from (lora) or the seed's weights (main). */
typedef struct train_job {
    const kt_program *program;
    const char *params;     /* a checkpoint directory for kt_session_load, or NULL */
    kt_dtype moe_dtype;
    kt_moe_quant moe_quant; /* KT_MOE_QUANT_NONE, or frozen experts stored INT8 / INT4 */
    int moe_group;          /* INT4's inputs per scale; 0: the library's default */
    kt_moe_mode moe_mode;
    int64_t moe_inter;      /* for moe ops that leave it open */
    int64_t lora_rank;
    float lora_alpha;
    int threads, steps, warmup;
    float lr;
    uint64_t seed;
} train_job;

/* The child's entry (train_proc_run): trains job (a train_job) for warmup + steps steps of
 * random token windows and prints one JSON line: tokens_per_s (a step's tokens over the median
 * step time), step_ms, trainable_params, losses (first, last). Errors: one line on stderr,
 * exit 1. */
int train_libkt_child(void *job);

/* Writes dir/config.json and dir/model.safetensors: a Qwen3-MoE (or DeepSeek-V2) of shape s
 * (the real config's keys, the checkpoint's tensor names) with bf16 weights drawn from seed
 * (norms 1), tensor by tensor from one pool of random values (the writer holds the pool, never
 * the checkpoint). Says on stderr what it writes. 0, or 1 after one line on stderr. */
int train_write_checkpoint(const char *dir, const train_shape *s, uint64_t seed);

#endif
