"""kt-export against transformers + PEFT: does what kt-export writes load, and give the logits
of the fine-tuned model?

    check_export.py KT_EXPORT WORKDIR

For each tiny architecture it builds a model from a config (random weights, fixed seed),
saves it as the source checkpoint, and writes a run file as kt_session_save would: every
tensor under its on-disk name plus random non-zero LoRA adapters (libkt's names: dense
"<module>.lora_A.weight" [r, in] / ".lora_B.weight" [out, r], and one adapter per routed
expert and projection) and an optimizer state to skip. The reference is the same checkpoint
with the deltas folded by hand, W + (alpha/r) B A in float64, loaded with from_pretrained.
Then kt-export --peft DIR (loaded with PeftModel.from_pretrained onto the source) and
kt-export --hf DIR --merged (loaded with from_pretrained) must give the reference's logits.
Exit 0 when all match, 1 otherwise, 77 when torch / transformers / peft are missing.
"""
import json
import os
import shutil
import subprocess
import sys
import warnings

try:
    import torch
    import transformers
    import peft
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"skipped: no PyTorch/PEFT ({e})")
    sys.exit(77)

from transformers import AutoModelForCausalLM

TOL = 1e-5  # logits, relative to their largest magnitude (f32 sources)
TOL_BF16 = 1e-3  # merged bf16 checkpoints: the reference rounds the fold to bf16 too
FIXTURES = os.environ.get("KT_HF_FIXTURES",
                          os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
R, ALPHA = 2, 6.0


def configs():
    """(case, config, adapted projections, shard size, fixture): the source is fix's fixture
    tests/hf/fixtures/<fixture>/ when it is there (KT_HF_FIXTURES overrides the directory),
    else a model built here from the config (the config is None for fixture-only cases)."""
    c = transformers
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                 max_position_embeddings=64, tie_word_embeddings=False)
    yield "mixtral", c.MixtralConfig(**small, intermediate_size=24, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2), \
        ["q_proj", "v_proj", "o_proj"], None, "mixtral"
    yield "qwen3_moe", c.Qwen3MoeConfig(**small, intermediate_size=48, moe_intermediate_size=16,
                                        num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, head_dim=8), \
        ["q_proj", "k_proj"], "30KB", "qwen3_moe"
    # q_proj adapted in layer 1 only: target_modules by path
    yield "mixtral_partial", c.MixtralConfig(**small, intermediate_size=24,
                                             num_key_value_heads=2, num_local_experts=4,
                                             num_experts_per_tok=2), \
        ["layers.1.self_attn.q_proj"], None, "mixtral"
    # Qwen2-MoE: the shared expert's Linear layers through target_modules as well
    yield "qwen2_moe", c.Qwen2MoeConfig(**small, intermediate_size=48, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24,
                                        num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2), \
        ["q_proj", "gate_proj", "up_proj", "down_proj"], None, "qwen2_moe"
    # DeepSeek-V2 (MLA), and with the shared experts and the dense first layer adapted too:
    # PEFT rewrites target_modules gate_proj into the fused experts there, so kt-export puts
    # them in target_parameters
    yield "deepseek_v2", c.DeepseekV2Config(**small, intermediate_size=48,
                                            moe_intermediate_size=16, num_key_value_heads=4,
                                            n_routed_experts=4, num_experts_per_tok=2,
                                            n_shared_experts=1, first_k_dense_replace=1,
                                            q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                                            qk_nope_head_dim=4, v_head_dim=4), \
        ["q_b_proj", "kv_b_proj"], None, "deepseek_v2"
    yield "deepseek_v2_shared", c.DeepseekV2Config(**small, intermediate_size=48,
                                                   moe_intermediate_size=16,
                                                   num_key_value_heads=4, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_shared_experts=1,
                                                   first_k_dense_replace=1, q_lora_rank=16,
                                                   kv_lora_rank=8, qk_rope_head_dim=4,
                                                   qk_nope_head_dim=4, v_head_dim=4), \
        ["q_b_proj", "gate_proj", "up_proj", "down_proj"], None, "deepseek_v2"
    yield "deepseek_v3", c.DeepseekV3Config(**small, intermediate_size=48,
                                            moe_intermediate_size=16, num_key_value_heads=4,
                                            n_routed_experts=4, num_experts_per_tok=2,
                                            n_shared_experts=1, first_k_dense_replace=1,
                                            n_group=2, topk_group=1, q_lora_rank=16,
                                            kv_lora_rank=8, qk_rope_head_dim=4,
                                            qk_nope_head_dim=4, v_head_dim=4), \
        ["kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"], None, "deepseek_v3"
    yield "olmoe", c.OlmoeConfig(**small, intermediate_size=16, num_key_value_heads=2,
                                 num_experts=4, num_experts_per_tok=2, pad_token_id=None), \
        ["v_proj", "o_proj"], None, "olmoe"
    # a dense relative: no experts, the MLP through target_modules
    yield "llama", c.LlamaConfig(**small, intermediate_size=48, num_key_value_heads=2), \
        ["q_proj", "gate_proj", "down_proj"], None, "llama"
    # fixtures only: a source transformers sharded, and bf16 sources (DeepSeek-V3's router
    # weight and score bias stay f32 there)
    yield "mixtral_sharded", None, ["q_proj", "k_proj"], None, "mixtral_sharded"
    yield "qwen3_moe_bf16", None, ["q_proj", "o_proj"], None, "qwen3_moe_bf16"
    yield "deepseek_v3_bf16", None, ["q_a_proj", "gate_proj", "up_proj", "down_proj"], None, \
        "deepseek_v3_bf16"


EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def is_expert(name):
    parts = name.split(".")
    return ".experts." in name and len(parts) > 5 and parts[-2] in EXPERT_PROJ


def load_dir(d):
    sd = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(d, f)))
    return sd


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def make_source(src, cfg, shard, fixture):
    """The source checkpoint in src; returns where it came from, or None to skip the case."""
    fx = os.path.join(FIXTURES, fixture)
    if os.path.isfile(os.path.join(fx, "config.json")):
        os.makedirs(src)
        for f in os.listdir(fx):
            if f == "config.json" or (f.startswith("model") and
                                      f.endswith((".safetensors", ".index.json"))):
                shutil.copy(os.path.join(fx, f), src)
        return "fixture " + fixture
    if cfg is None:
        return None
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    base = AutoModelForCausalLM.from_config(cfg)
    if shard:
        base.save_pretrained(src, max_shard_size=shard)
    else:
        base.save_pretrained(src)
    return "built from a config"


def check_arch(kt_export, work, arch, cfg, targets, shard, fixture):
    ok = True
    src = os.path.join(work, arch, "source")
    shutil.rmtree(os.path.join(work, arch), ignore_errors=True)
    origin = make_source(src, cfg, shard, fixture)
    if origin is None:
        print(f"{arch}: no fixture {fixture} in {FIXTURES} (they are committed)")
        return False
    cfg = transformers.AutoConfig.from_pretrained(src)
    sd = load_dir(src)
    dtype = next(v.dtype for k, v in sd.items() if k.endswith("embed_tokens.weight"))
    tol = TOL if dtype == torch.float32 else TOL_BF16
    g = torch.Generator().manual_seed(99)
    adapted = set()
    run = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    folded = {k: v.double() for k, v in sd.items()}
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        leaf = module.split(".")[-1]
        chosen = leaf in targets or any("." in t and module.endswith(t) for t in targets)
        if not (is_expert(name) or (chosen and ".experts." not in name)):
            continue
        a = torch.randn(R, w.shape[1], generator=g) * 0.2
        b = torch.randn(w.shape[0], R, generator=g) * 0.2
        run[module + ".lora_A.weight"], run[module + ".lora_B.weight"] = a, b
        if not is_expert(name):
            adapted.add(leaf)
        folded[name] = folded[name] + (ALPHA / R) * (b.double() @ a.double())
    run["optimizer.m.model.norm.weight"] = torch.zeros_like(sd["model.norm.weight"])
    run_path = os.path.join(work, arch, "run.safetensors")
    save_file({k: v.contiguous() for k, v in run.items()}, run_path)
    imp = os.path.join(work, arch, "import.json")
    with open(imp, "w") as f:
        # as kt-import writes it; its gate_proj/up_proj/down_proj reach the routed experts too
        mlp = ["gate_proj", "up_proj", "down_proj"] if any(map(is_expert, sd)) else []
        json.dump({"format": "kt-import 1", "source": os.path.abspath(src),
                   "model_type": cfg.model_type,
                   "dtype": "f32" if dtype == torch.float32 else "bf16", "lora_rank": R,
                   "lora_alpha": int(ALPHA), "lora_targets": sorted(adapted | set(mlp)),
                   "moe_mode": "lora" if mlp else None}, f)
    ref_dir = os.path.join(work, arch, "reference")
    os.makedirs(ref_dir)
    shutil.copy(os.path.join(src, "config.json"), ref_dir)
    # the fold rounded once to each tensor's source dtype
    save_file({k: v.to(sd[k].dtype).contiguous() for k, v in folded.items()},
              os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})

    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    ref = logits_of(AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager"), ids)
    # the adapter is f32 whatever the base: PEFT's check runs the base widened to f32 (exact)
    # against the fold kept in f32
    ref32 = ref
    if dtype != torch.float32:
        save_file({k: v.float().contiguous() if v.is_floating_point() else v
                   for k, v in folded.items()},
                  os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
        ref32 = logits_of(AutoModelForCausalLM.from_pretrained(
            ref_dir, attn_implementation="eager", dtype=torch.float32), ids)
    plain = logits_of(AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager"), ids)
    moved = rel(plain, ref)
    if moved < 1e-3:
        print(f"{arch}: FAIL the adapters hardly change the logits ({moved:.2e}): no test")
        ok = False

    peft_dir = os.path.join(work, arch, "peft")
    p = subprocess.run([kt_export, run_path, "--import", imp, "--peft", peft_dir],
                       capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{arch}: FAIL kt-export --peft: rc {p.returncode}: {p.stderr.strip()}")
        ok = False
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src_model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager",
                                                             dtype=torch.float32)
            pm = peft.PeftModel.from_pretrained(src_model, peft_dir)
        got = logits_of(pm, ids)
        e = rel(got, ref32)
        print(f"{arch} ({origin}): PEFT adapter logits vs folded reference: {e:.2e} "
              f"(the adapters move them by {moved:.2e})")
        ok &= e <= TOL

    hf_dir = os.path.join(work, arch, "merged")
    p = subprocess.run([kt_export, run_path, "--import", imp, "--hf", hf_dir, "--merged"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{arch}: FAIL kt-export --hf --merged: rc {p.returncode}: {p.stderr.strip()}")
        return False
    src_files = sorted(f for f in os.listdir(src) if f.endswith((".safetensors", ".json")))
    out_files = sorted(f for f in os.listdir(hf_dir) if f.endswith((".safetensors", ".json")))
    if src_files != out_files:
        print(f"{arch}: FAIL files {out_files}, the source has {src_files}")
        ok = False
    got = logits_of(AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager"), ids)
    e = rel(got, ref)
    for k, v in load_dir(hf_dir).items():
        if v.dtype != sd[k].dtype:
            print(f"{arch}: FAIL merged tensor {k} is {v.dtype}, the source's is {sd[k].dtype}")
            ok = False
    print(f"{arch}: merged checkpoint ({len(out_files)} files) logits vs folded reference: {e:.2e}")
    ok &= e <= tol
    return ok


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    kt_export, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    ok = True
    for arch, cfg, targets, shard, fixture in configs():
        ok &= check_arch(kt_export, work, arch, cfg, targets, shard, fixture)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
