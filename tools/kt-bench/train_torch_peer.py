#!/usr/bin/env python3
"""PyTorch's training of the model kt-bench train measures libkt on: the peer.

transformers' Qwen3MoeForCausalLM (the architecture of examples/moe_lm.ktg and of kt-import's
qwen3_moe programs), trained as its users train it: torch.optim.AdamW, loss.backward(), one
batch of random token ids per step (labels = the ids: the model shifts them), sdpa attention
(transformers' default), its default experts implementation unless --experts-impl says.

  --config main   the model built from the sizes given (f32, random init), every parameter
                  trained, the load-balancing loss added when --aux-coef > 0 (as
                  output_router_logits=True does)
  --config lora   the checkpoint in --model (from_pretrained, bf16: the base frozen in bf16 as
                  users load it), PEFT LoRA r / alpha on q/k/v/o and gate_proj/up_proj/down_proj
                  (PEFT 0.21 turns the last three into its parameter adapters on the fused
                  experts: gate_up_proj at rank 2r, alpha 2 alpha, and down_proj at rank r;
                  adapters f32, PEFT's autocast of adapters over a bf16 base)

Prints one JSON object on stdout at the end: tokens_per_s (tokens of a step over the median
step time), step_ms (that median), peak_rss_bytes (getrusage ru_maxrss), trainable_params,
losses (first and last), versions, threads.
Exit 77 when torch, transformers (or, for lora, peft) is missing: the caller reports null.
"""
import argparse
import json
import resource
import statistics
import sys
import time

try:
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
except ImportError as e:  # the caller prints a note and a null ratio
    print(json.dumps({"error": f"torch or transformers missing: {e}"}))
    sys.exit(77)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["main", "lora"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--experts-impl", default=None,
                    help="transformers' experts implementation (eager, grouped_mm, batched_mm)")
    # main: the sizes of the libkt program
    for k in ("vocab", "hidden", "heads", "kv-heads", "head-dim", "experts", "top-k", "inter",
              "layers"):
        ap.add_argument("--" + k, type=int)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--norm-topk", type=int, default=0)
    ap.add_argument("--aux-coef", type=float, default=0.0)
    # lora
    ap.add_argument("--model")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    return ap.parse_args()


def main_model(a):
    need = ("vocab", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "inter",
            "layers")
    missing = [n for n in need if getattr(a, n) is None]
    if missing:
        sys.exit("--config main needs --" + ", --".join(m.replace("_", "-") for m in missing))
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter,
        intermediate_size=a.inter, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=bool(a.norm_topk), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        max_position_embeddings=max(a.seq, 128), tie_word_embeddings=False,
        output_router_logits=a.aux_coef > 0, router_aux_loss_coef=a.aux_coef,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, use_cache=False,
        attn_implementation="sdpa")
    if a.experts_impl:
        cfg._experts_implementation = a.experts_impl
    model = Qwen3MoeForCausalLM(cfg)  # f32, transformers' init
    return model, a.vocab


def lora_model(a):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        print(json.dumps({"error": f"peft missing: {e}"}))
        sys.exit(77)
    if not a.model:
        sys.exit("--config lora needs --model DIR")
    kw = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    if a.experts_impl:
        kw["experts_implementation"] = a.experts_impl
    model = Qwen3MoeForCausalLM.from_pretrained(a.model, **kw)
    model.config.use_cache = False
    lc = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"])
    model = get_peft_model(model, lc)  # adapters cast to f32 over the bf16 base
    return model, model.config.vocab_size


def main():
    a = parse()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model, vocab = main_model(a) if a.config == "main" else lora_model(a)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)  # libkt's AdamW: no decay
    gen = torch.Generator().manual_seed(a.seed)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(float(out.loss.detach()))
        if step >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    experts = getattr(model.config, "_experts_implementation", None)
    print(json.dumps({
        "tokens_per_s": a.batch * a.seq / med,
        "step_ms": med * 1e3,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trainable_params": sum(p.numel() for p in params),
        "trainable_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
        "losses": [losses[0], losses[-1]],
        "attn": "sdpa", "experts_impl": experts,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
