#!/usr/bin/env python3
"""Write the transformers reference fixtures libkt's tests compare against.

Each fixture is a tiny model of one architecture built by transformers from a
config alone (random weights, fixed seed, offline), saved with save_pretrained,
plus reference.safetensors: the inputs, transformers' logits and loss, and the
gradient of every tensor on disk under its on-disk name.  See tests/hf/README.md.

Run with the venv that has torch + transformers + peft:
    /work/venv-torch/bin/python tests/hf/make_fixtures.py [--arch NAME ...]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

B, S = 2, 8
VOCAB = 128
INIT_RANGE = 0.1
INPUT_SEED = 20260
MIN_GAP = 1e-3
SEEDS = range(0, 200)
# Label positions set to -100: a few in the middle, and labels[1, 1] whose
# shifted target is position 0's.
MASKED_LABELS = [(0, 3), (1, 1), (1, 5), (1, 6)]
LORA_R, LORA_ALPHA = 4, 8
LORA_A_STD, LORA_B_STD = 0.1, 0.05
SCORE_BIAS_STD = 0.05
NORM_BIAS_STD = 0.1

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2,
              initializer_range=INIT_RANGE, max_position_embeddings=64,
              tie_word_embeddings=False, pad_token_id=None)


def rope(theta):
    return {"rope_type": "default", "rope_theta": float(theta)}


# arch -> (config class, options). Every arch differs somewhere (theta,
# biases, norms, routing) so that an importer cannot pass by guessing.
ARCHS = {
    "mixtral": ("MixtralConfig", dict(
        head_dim=8, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters=rope(1e6))),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, qkv_bias=True, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=rope(1e6))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=rope(1e6))),
    "olmoe": ("OlmoeConfig", dict(
        intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, rope_parameters=rope(500.0))),
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=2, topk_group=1, routed_scaling_factor=1.5,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
        rope_parameters=rope(1e4))),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
        rope_parameters=rope(1e4))),
    "llama": ("LlamaConfig", dict(
        head_dim=8, intermediate_size=48, tie_word_embeddings=True,
        rope_parameters=rope(5e5))),
    "qwen2": ("Qwen2Config", dict(
        intermediate_size=48, rope_parameters=rope(1e6))),
    "qwen3": ("Qwen3Config", dict(
        head_dim=8, intermediate_size=48, rope_parameters=rope(1e6))),
}
AUX_ARCHS = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
EXTRAS = ["mixtral_sharded", "qwen3_moe_bf16", "deepseek_v3_bf16",
          "qwen3_moe_lora", "mixtral_lora"]
ALL = list(ARCHS) + EXTRAS


def fail(msg):
    raise SystemExit("make_fixtures: " + msg)


def import_stack():
    global torch, transformers, peft, safetensors, st_load
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    import peft
    import safetensors
    from safetensors.torch import load_file as st_load
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def make_config(arch):
    cls, opts = ARCHS[arch]
    kw = dict(COMMON)
    kw.update(opts)
    cfg = getattr(transformers, cls)(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def fixed_inputs():
    g = torch.Generator().manual_seed(INPUT_SEED)
    ids = torch.randint(0, VOCAB, (B, S), generator=g, dtype=torch.int64)
    labels = ids.clone()
    for b, s in MASKED_LABELS:
        labels[b, s] = -100
    return ids, labels


def build(arch, seed):
    """The model transformers initialises from the config with this seed."""
    cfg = make_config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager")
    # transformers initialises norm weights to 1 and biases to 0: a reader
    # that dropped them would still match. Make them count.
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * NORM_BIAS_STD)
            elif p.dim() == 1 and "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * NORM_BIAS_STD)
    if arch == "deepseek_v3":
        # The correction bias is a zero buffer at init; make it matter.
        g = torch.Generator().manual_seed(seed + 1000)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                b = gate.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=g) * SCORE_BIAS_STD)
    return model.float().eval()


def load(path, dtype):
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager",
        experts_implementation="eager")
    return m.eval()


# ---------------------------------------------------------------- routing

def routers(model):
    """(layer index, router module) for every MoE layer."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            out.append((i, gate))
    return out


class RouterTap:
    """Records each router's logits and chosen experts during a forward."""

    def __init__(self, model):
        self.seen = {}
        self.handles = []
        for i, gate in routers(model):
            self.handles.append(gate.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def f(mod, inp, out):
            logits, _, idx = out
            self.seen[i] = (logits.detach().float().clone(),
                            idx.detach().clone(), mod)
        return f

    def close(self):
        for h in self.handles:
            h.remove()


def topk_gap(scores, k):
    """Per row: k-th largest minus (k+1)-th largest."""
    v = scores.sort(dim=-1, descending=True).values
    return v[:, k - 1] - v[:, k]


def decision_gaps(mod, logits):
    """The margins that decide this router's choice, per token.

    Returns (gap in the space the choice is made on, recomputed choice):
    softmax routers choose by logits (monotone in the probabilities), so
    the gap is in logits; DeepSeek-V2's group-limited greedy ranks groups
    by their largest logit, then experts inside the kept groups; V3 ranks
    sigmoid(logit) + e_score_correction_bias (groups by the sum of their
    top two)."""
    k = mod.top_k
    name = type(mod).__name__
    if name.startswith("DeepseekV3"):
        c = logits.sigmoid() + mod.e_score_correction_bias.float()
        ng, tg = mod.num_group, mod.topk_group
        grp = c.view(-1, ng, c.shape[1] // ng).topk(2, dim=-1)[0].sum(-1)
    elif name.startswith("DeepseekV2") and mod.topk_method == "group_limited_greedy":
        c = logits
        ng, tg = mod.num_group, mod.topk_group
        grp = c.view(-1, ng, c.shape[1] // ng).max(dim=-1).values
    else:
        c, grp = logits, None
    gaps = []
    if grp is not None:
        if tg < ng:
            gaps.append(topk_gap(grp, tg))
        keep = torch.zeros_like(grp, dtype=torch.bool)
        keep.scatter_(1, grp.topk(tg, dim=-1)[1], True)
        keep = keep.repeat_interleave(c.shape[1] // ng, dim=1)
        c = c.masked_fill(~keep, float("-inf"))
        if int(keep[0].sum()) > k:
            gaps.append(topk_gap(c, k))
    else:
        gaps.append(topk_gap(c, k))
    gap = torch.stack(gaps, 0).min(0).values
    choice = c.topk(k, dim=-1)[1].sort(dim=-1).values
    return gap, choice


def routing_summary(tap):
    """{layer: (min decision gap, min probability gap or None, experts)}"""
    out = {}
    for i, (logits, idx, mod) in sorted(tap.seen.items()):
        gap, choice = decision_gaps(mod, logits)
        chosen = idx.sort(dim=-1).values
        if not torch.equal(chosen, choice):
            fail("layer %d: recomputed routing differs from transformers'" % i)
        pgap = None
        if not type(mod).__name__.startswith(("DeepseekV3", "DeepseekV2")):
            pgap = float(topk_gap(logits.softmax(-1), mod.top_k).min())
        out[i] = (float(gap.min()), pgap, chosen.to(torch.int64))
    return out


def gaps_ok(summary):
    return all(g >= MIN_GAP and (p is None or p >= MIN_GAP)
               for g, p, _ in summary.values())


def probe(model, ids):
    tap = RouterTap(model)
    with torch.no_grad():
        model(input_ids=ids)
    tap.close()
    return routing_summary(tap)


# ---------------------------------------------------------------- grads

def on_disk(model, tensors):
    """Map in-memory tensors (by state_dict name) to the on-disk names the
    way save_pretrained does."""
    from transformers.core_model_loading import revert_weight_conversion
    return {k: v.contiguous() for k, v in
            revert_weight_conversion(model, dict(tensors)).items()}


def check_mapping(model, files):
    """The name mapping must reproduce the saved tensors bit-exactly."""
    disk = {}
    for f in files:
        disk.update(st_load(f))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    mapped = on_disk(model, sd)
    missing = set(disk) - set(mapped)
    if missing:
        fail("mapping misses %s" % sorted(missing)[:4])
    # save_pretrained may drop only tied tensors (llama's lm_head.weight)
    kept = {mapped[k].data_ptr() for k in disk}
    dropped = [k for k in set(mapped) - set(disk) if mapped[k].data_ptr() not in kept]
    if dropped:
        fail("save_pretrained dropped untied tensors %s" % sorted(dropped)[:4])
    for k, v in disk.items():
        m = mapped[k].to(v.dtype)
        if m.shape != v.shape or not torch.equal(m, v):
            fail("mapping of %s does not reproduce the saved tensor" % k)
    return disk


def grads_on_disk(model, disk):
    """grad.<on-disk name> for every saved tensor; buffers get zeros."""
    params = dict(model.named_parameters(remove_duplicate=False))
    grads = {}
    for k, v in model.state_dict().items():
        p = params.get(k)
        if p is not None and p.grad is not None:
            grads[k] = p.grad.detach().float()
        else:
            grads[k] = torch.zeros(v.shape, dtype=torch.float32)
    mapped = on_disk(model, grads)
    return {"grad." + k: mapped[k].float().contiguous() for k in disk}


def forward_backward(model, ids, labels):
    """CE loss (no aux) forward+backward; returns logits, loss, routing."""
    model.zero_grad(set_to_none=True)
    tap = RouterTap(model)
    out = model(input_ids=ids, labels=labels, output_router_logits=False)
    tap.close()
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), tap


def aux_loss(model, ids, labels):
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, output_router_logits=True)
    return out.aux_loss.detach().float().reshape(1)


# ---------------------------------------------------------------- writing

ST_DTYPES = None


def write_st(path, tensors, meta):
    """safetensors with a byte-stable header: metadata keys sorted (the
    library writes them in hash order), tensors by descending element size
    then name so every tensor's data is aligned to its element size."""
    global ST_DTYPES
    if ST_DTYPES is None:
        ST_DTYPES = {torch.float32: "F32", torch.int64: "I64",
                     torch.bfloat16: "BF16", torch.float16: "F16"}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header = {"__metadata__": {k: meta[k] for k in sorted(meta)}}
    blobs, off = [], 0
    for k in order:
        t = tensors[k].detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[k] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)
    back = st_load(path)
    for k, v in tensors.items():
        if not torch.equal(back[k], v.detach().cpu()):
            fail("%s: %s does not read back" % (path, k))


def versions():
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "safetensors": safetensors.__version__}


def base_meta(arch, seed):
    m = {"arch": arch, "seed": str(seed), "input_seed": str(INPUT_SEED),
         "B": str(B), "S": str(S), "initializer_range": str(INIT_RANGE),
         "masked_labels": json.dumps(MASKED_LABELS),
         "attn_implementation": "eager", "experts_implementation": "eager",
         "min_gap_required": str(MIN_GAP),
         "norm_weights": "1 + N(0, %g)" % NORM_BIAS_STD,
         "biases": "N(0, %g)" % NORM_BIAS_STD}
    if arch == "deepseek_v3":
        m["e_score_correction_bias"] = "N(0, %g)" % SCORE_BIAS_STD
    for k, v in versions().items():
        m["version." + k] = v
    return m


def add_routing(tensors, meta, summary, prefix="router"):
    for i, (gap, pgap, experts) in summary.items():
        tensors["%s.%d.experts" % (prefix, i)] = experts.contiguous()
        if prefix == "router":
            meta["min_topk_logit_gap.%d" % i] = "%.6g" % gap
            if pgap is not None:
                meta["min_topk_prob_gap.%d" % i] = "%.6g" % pgap
    if prefix == "router":
        meta["moe_layers"] = json.dumps(sorted(summary))


def save_model(model, out, **kw):
    """save_pretrained into a temporary dir, keep config + safetensors."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, **kw)
        os.makedirs(out, exist_ok=True)
        for f in sorted(os.listdir(tmp)):
            if f == "config.json" or f.startswith("model") and (
                    f.endswith(".safetensors") or f.endswith(".index.json")):
                shutil.copyfile(os.path.join(tmp, f), os.path.join(out, f))
    return sorted(os.path.join(out, f) for f in os.listdir(out)
                  if f.endswith(".safetensors") and f.startswith("model"))


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def pick_seed(arch, ids, make=None):
    """First seed whose routing margins are all >= MIN_GAP."""
    make = make or (lambda s: build(arch, s))
    for seed in SEEDS:
        model = make(seed)
        if gaps_ok(probe(model, ids)):
            return seed, model
    fail("%s: no seed in %s gives margins >= %g" % (arch, SEEDS, MIN_GAP))


def reference(model, disk, ids, labels, arch, seed, with_aux):
    logits, loss, tap = forward_backward(model, ids, labels)
    summary = routing_summary(tap)
    t = {"input_ids": ids, "labels": labels, "logits": logits.contiguous(),
         "loss": loss.reshape(1)}
    t.update(grads_on_disk(model, disk))
    meta = base_meta(arch, seed)
    add_routing(t, meta, summary)
    if with_aux:
        t["aux_loss"] = aux_loss(model, ids, labels)
        meta["router_aux_loss_coef"] = str(model.config.router_aux_loss_coef)
    return t, meta


def write_base(arch, outdir, ids, labels, shard=None):
    seed, model = pick_seed(arch, ids)
    out = os.path.join(outdir, arch if shard is None else arch + "_sharded")
    fresh_dir(out)
    kw = {} if shard is None else {"max_shard_size": shard}
    files = save_model(model, out, **kw)
    if shard is not None and len(files) < 3:
        fail("%s: only %d shards" % (out, len(files)))
    disk = check_mapping(model, files)
    t, meta = reference(model, disk, ids, labels, arch, seed, arch in AUX_ARCHS)
    if shard is not None:
        meta["shards"] = str(len(files))
    write_st(os.path.join(out, "reference.safetensors"), t, meta)
    return out


def write_bf16(arch, outdir, ids, labels):
    """bf16 checkpoint (transformers' keep-fp32 rules), the f32 reference of
    the same rounded weights, and transformers' native bf16 run."""
    tmp = tempfile.TemporaryDirectory()

    def rounded(seed):
        d = os.path.join(tmp.name, str(seed))
        save_model(build(arch, seed), d)
        save_model(load(d, torch.bfloat16), d + "_bf16")
        return load(d + "_bf16", torch.float32)

    seed, model = pick_seed(arch, ids, rounded)
    out = os.path.join(outdir, arch + "_bf16")
    fresh_dir(out)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(tmp.name, "%d_bf16" % seed, f),
                        os.path.join(out, f))
    tmp.cleanup()
    files = [os.path.join(out, "model.safetensors")]
    disk = check_mapping(model, files)
    logits32, loss32, tap = forward_backward(model, ids, labels)
    summary = routing_summary(tap)
    t = {"input_ids": ids, "labels": labels,
         "logits_f32": logits32.contiguous(), "loss_f32": loss32.reshape(1)}
    t.update(grads_on_disk(model, disk))
    meta = base_meta(arch, seed)
    add_routing(t, meta, summary)
    if arch in AUX_ARCHS:
        t["aux_loss_f32"] = aux_loss(model, ids, labels)
    meta["kept_f32"] = json.dumps(sorted(
        k for k, v in disk.items() if v.dtype == torch.float32))
    native = load(out, torch.bfloat16)
    tap = RouterTap(native)
    with torch.no_grad():
        o = native(input_ids=ids, labels=labels)
    tap.close()
    t["logits"] = o.logits.float().contiguous()
    t["loss"] = o.loss.float().reshape(1)
    flips = 0
    for i, (_, idx, _) in sorted(tap.seen.items()):
        e = idx.sort(dim=-1).values.to(torch.int64).contiguous()
        t["router_bf16.%d.experts" % i] = e
        flips += int((e != summary[i][2]).any(dim=-1).sum())
    meta["bf16_rows_routed_differently"] = str(flips)
    write_st(os.path.join(out, "reference.safetensors"), t, meta)
    return out


# ---------------------------------------------------------------- LoRA

def expert_names(arch, layer, e):
    """On-disk names of expert e's gate, up, down projections (no .weight)."""
    if arch == "mixtral":
        p = "model.layers.%d.block_sparse_moe.experts.%d." % (layer, e)
        return p + "w1", p + "w3", p + "w2"
    p = "model.layers.%d.mlp.experts.%d." % (layer, e)
    return p + "gate_proj", p + "up_proj", p + "down_proj"


def draw_adapters(model, arch, seed):
    """The split adapters: attention q/k/v/o and per-expert gate/up/down.
    Returns {name: tensor} in libkt's (KTransformers') layout."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    H = cfg.hidden_size
    ad = {}
    for i, layer in enumerate(model.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, proj)
            n = "model.layers.%d.self_attn.%s" % (i, proj)
            ad[n + ".lora_A.weight"] = torch.randn(
                LORA_R, lin.in_features, generator=g) * LORA_A_STD
            ad[n + ".lora_B.weight"] = torch.randn(
                lin.out_features, LORA_R, generator=g) * LORA_B_STD
        experts = layer.mlp.experts
        E, I = experts.down_proj.shape[0], experts.down_proj.shape[2]
        for e in range(E):
            for n, (fi, fo) in zip(expert_names(arch, i, e),
                                   ((H, I), (H, I), (I, H))):
                ad[n + ".lora_A.weight"] = torch.randn(
                    LORA_R, fi, generator=g) * LORA_A_STD
                ad[n + ".lora_B.weight"] = torch.randn(
                    fo, LORA_R, generator=g) * LORA_B_STD
    return ad


def peft_config():
    return peft.LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        # gate and up are one stacked parameter: a rank-2r adapter whose
        # B is block-diagonal holds the two separate rank-r adapters.
        rank_pattern={"gate_up_proj": 2 * LORA_R},
        alpha_pattern={"gate_up_proj": 2 * LORA_ALPHA})


def peft_modules(pm):
    """{(layer, 'gate_up'|'down'): ParamWrapper} and attention LoRA layers."""
    wrappers, attn = {}, {}
    for n, mod in pm.named_modules():
        parts = n.split(".")
        j = parts.index("layers") + 1 if "layers" in parts else len(parts)
        if j >= len(parts) or not parts[j].isdigit():
            continue
        i = int(parts[j])
        if type(mod).__name__ == "ParamWrapper":
            kind = {"gate_up_proj": "gate_up", "down_proj": "down"}[mod.parameter_name]
            wrappers[(i, kind)] = mod
        elif parts[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") and hasattr(mod, "lora_A"):
            attn[(i, parts[-1])] = mod
    return wrappers, attn


def install(pm, arch, ad):
    """Write the split adapters into PEFT's tensors (layout: research note,
    expert e = rows e*r.. of A, columns j*E + e of B)."""
    wrappers, attn = peft_modules(pm)
    r = LORA_R
    with torch.no_grad():
        for (i, proj), mod in attn.items():
            n = "model.layers.%d.self_attn.%s" % (i, proj)
            mod.lora_A["default"].weight.copy_(ad[n + ".lora_A.weight"])
            mod.lora_B["default"].weight.copy_(ad[n + ".lora_B.weight"])
        for (i, kind), mod in wrappers.items():
            A = mod.lora_A["default"].weight
            Bm = mod.lora_B["default"].weight
            E = A.shape[0] // (2 * r if kind == "gate_up" else r)
            A.zero_()
            Bm.zero_()
            Av = A.view(E, -1, A.shape[1])
            Bv = Bm.view(Bm.shape[0], -1, E)
            for e in range(E):
                gn, un, dn = expert_names(arch, i, e)
                if kind == "down":
                    Av[e].copy_(ad[dn + ".lora_A.weight"])
                    Bv[:, :, e].copy_(ad[dn + ".lora_B.weight"])
                else:
                    I = Bm.shape[0] // 2
                    Av[e, :r].copy_(ad[gn + ".lora_A.weight"])
                    Av[e, r:].copy_(ad[un + ".lora_A.weight"])
                    Bv[:I, :r, e].copy_(ad[gn + ".lora_B.weight"])
                    Bv[I:, r:, e].copy_(ad[un + ".lora_B.weight"])


def extract_grads(pm, arch):
    """grad.<split adapter name> from PEFT's gradients (diagonal blocks)."""
    wrappers, attn = peft_modules(pm)
    r = LORA_R
    gr = {}
    for (i, proj), mod in attn.items():
        n = "model.layers.%d.self_attn.%s" % (i, proj)
        gr["grad." + n + ".lora_A.weight"] = mod.lora_A["default"].weight.grad.clone()
        gr["grad." + n + ".lora_B.weight"] = mod.lora_B["default"].weight.grad.clone()
    for (i, kind), mod in wrappers.items():
        gA = mod.lora_A["default"].weight.grad
        gB = mod.lora_B["default"].weight.grad
        E = gA.shape[0] // (2 * r if kind == "gate_up" else r)
        Av = gA.view(E, -1, gA.shape[1])
        Bv = gB.view(gB.shape[0], -1, E)
        for e in range(E):
            gn, un, dn = expert_names(arch, i, e)
            if kind == "down":
                gr["grad." + dn + ".lora_A.weight"] = Av[e].clone()
                gr["grad." + dn + ".lora_B.weight"] = Bv[:, :, e].clone()
            else:
                I = gB.shape[0] // 2
                gr["grad." + gn + ".lora_A.weight"] = Av[e, :r].clone()
                gr["grad." + un + ".lora_A.weight"] = Av[e, r:].clone()
                gr["grad." + gn + ".lora_B.weight"] = Bv[:I, :r, e].clone()
                gr["grad." + un + ".lora_B.weight"] = Bv[I:, r:, e].clone()
    return {k: v.float().contiguous() for k, v in gr.items()}


def folded(base_dir, arch, ad, ids, labels):
    """Independent check: W_eff = W + (alpha/r) B A folded into the base
    weights with torch.func.functional_call, autograd on the split tensors."""
    model = load(base_dir, torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    leaves = {k: v.clone().requires_grad_(True) for k, v in ad.items()}
    s = LORA_ALPHA / LORA_R
    over = {}
    for i, layer in enumerate(model.model.layers):
        pre = "model.layers.%d." % i
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            n = pre + "self_attn." + proj
            w = getattr(layer.self_attn, proj).weight
            over[n + ".weight"] = w + s * leaves[n + ".lora_B.weight"] @ leaves[n + ".lora_A.weight"]
        ex = layer.mlp.experts
        E = ex.down_proj.shape[0]
        gu, dn_ = [], []
        for e in range(E):
            g, u, d = expert_names(arch, i, e)
            dg = s * leaves[g + ".lora_B.weight"] @ leaves[g + ".lora_A.weight"]
            du = s * leaves[u + ".lora_B.weight"] @ leaves[u + ".lora_A.weight"]
            dd = s * leaves[d + ".lora_B.weight"] @ leaves[d + ".lora_A.weight"]
            gu.append(torch.cat([dg, du], 0))
            dn_.append(dd)
        over[pre + "mlp.experts.gate_up_proj"] = ex.gate_up_proj + torch.stack(gu)
        over[pre + "mlp.experts.down_proj"] = ex.down_proj + torch.stack(dn_)
    out = torch.func.functional_call(
        model, over, args=(), kwargs=dict(input_ids=ids, labels=labels))
    out.loss.backward()
    return (out.logits.detach(), out.loss.detach(),
            {"grad." + k: v.grad for k, v in leaves.items()})


def rel(a, b):
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def write_lora(arch, outdir, ids, labels):
    base_dir = os.path.join(outdir, arch)
    if not os.path.isfile(os.path.join(base_dir, "reference.safetensors")):
        fail("%s_lora needs %s first" % (arch, base_dir))
    ref = st_load(os.path.join(base_dir, "reference.safetensors"))
    if not (torch.equal(ref["input_ids"], ids) and torch.equal(ref["labels"], labels)):
        fail("%s: inputs differ from the base fixture's" % base_dir)
    # First adapter seed whose routing margins (the adapters move the
    # router inputs) stay >= MIN_GAP.
    for seed in SEEDS:
        model = load(base_dir, torch.float32)
        ad = draw_adapters(model, arch, seed)
        pm = peft.get_peft_model(model, peft_config())
        install(pm, arch, ad)
        if gaps_ok(probe(pm.base_model.model, ids)):
            break
    else:
        fail("%s_lora: no adapter seed gives margins >= %g" % (arch, MIN_GAP))
    tap = RouterTap(pm.base_model.model)
    out = pm(input_ids=ids, labels=labels)
    tap.close()
    out.loss.backward()
    logits, loss = out.logits.detach().float(), out.loss.detach().float()
    grads = extract_grads(pm, arch)
    if set(grads) != {"grad." + k for k in ad}:
        fail("%s: adapter gradients do not cover the adapters" % arch)
    f_logits, f_loss, f_grads = folded(base_dir, arch, ad, ids, labels)
    worst = max([rel(logits, f_logits), rel(loss, f_loss)] +
                [rel(grads[k], f_grads[k]) for k in grads])
    if worst > 1e-5:
        fail("%s: PEFT and the folded formula differ by %g" % (arch, worst))
    out_dir = os.path.join(outdir, arch + "_lora")
    fresh_dir(out_dir)
    t = {"input_ids": ids, "labels": labels, "logits": logits.contiguous(),
         "loss": loss.reshape(1)}
    t.update({k: v.contiguous() for k, v in ad.items()})
    t.update(grads)
    meta = base_meta(arch, ref_seed(base_dir))
    meta.update({"lora_seed": str(seed), "lora_r": str(LORA_R),
                 "lora_alpha": str(LORA_ALPHA), "lora_A_std": str(LORA_A_STD),
                 "lora_B_std": str(LORA_B_STD), "base": "../" + arch,
                 "peft_vs_folded_max_rel": "%.3g" % worst})
    add_routing(t, meta, routing_summary(tap))
    write_st(os.path.join(out_dir, "lora_reference.safetensors"), t, meta)
    # PEFT's own adapter (block-diagonal rank-2r gate_up), for check_peft.py
    ad_dir = os.path.join(out_dir, "peft_adapter")
    pm.save_pretrained(ad_dir)
    cfgp = os.path.join(ad_dir, "adapter_config.json")
    with open(cfgp) as f:
        c = json.load(f)
    c["base_model_name_or_path"] = "../" + arch  # not this machine's path
    for k, v in c.items():
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            c[k] = sorted(v)  # PEFT writes sets in hash order
    with open(cfgp, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    for f in os.listdir(ad_dir):
        if f not in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(ad_dir, f))
    return out_dir


def ref_seed(base_dir):
    from safetensors import safe_open
    with safe_open(os.path.join(base_dir, "reference.safetensors"), "pt") as f:
        return f.metadata()["seed"]


# ---------------------------------------------------------------- main

def generate(out, todo):
    ids, labels = fixed_inputs()
    for name in todo:
        if name in ARCHS:
            d = write_base(name, out, ids, labels)
        elif name == "mixtral_sharded":
            d = write_base("mixtral", out, ids, labels, shard="40KB")
        elif name.endswith("_bf16"):
            d = write_bf16(name[:-5], out, ids, labels)
        else:
            d = write_lora(name[:-5], out, ids, labels)
        yield d


def tree(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def check(ref_dir, todo):
    with tempfile.TemporaryDirectory() as tmp:
        for name in todo:
            if name.endswith("_lora"):  # needs its base fixture
                base = name[:-5]
                if not os.path.isdir(os.path.join(tmp, base)):
                    shutil.copytree(os.path.join(ref_dir, base), os.path.join(tmp, base))
        list(generate(tmp, todo))
        bad = close = 0
        for name in todo:
            new = tree(os.path.join(tmp, name))
            old = tree(os.path.join(ref_dir, name)) if os.path.isdir(os.path.join(ref_dir, name)) else {}
            for f in sorted(set(new) | set(old)):
                if new.get(f) == old.get(f):
                    continue
                worst = None
                if f.endswith("reference.safetensors") and f in new and f in old:
                    worst = reference_difference(new[f], old[f])
                if worst is not None and worst <= REFERENCE_TOLERANCE:
                    print("close: %s/%s (computed outputs within %.2g of each tensor's largest "
                          "magnitude: another CPU's kernels round differently)" % (name, f, worst))
                    close += 1
                else:
                    print("differs: %s/%s%s" % (name, f, "" if worst is None else
                                                  " (worst %.3g)" % worst))
                    bad += 1
    print("make_fixtures --check: %d fixture(s), %d file(s) differ, %d within %g" %
          (len(todo), bad, close, REFERENCE_TOLERANCE))
    return 1 if bad else 0


# What transformers computed (logits, loss, gradients) may differ in the last bits on another
# CPU (torch picks its kernels by the instruction set: 2e-6 of the largest gradient between an
# AVX-512 and an AVX2 machine); the inputs, which the seeds make, must not. The tests compare
# libkt with these files at 1e-5 (logits) and 1e-4 (gradients).
REFERENCE_TOLERANCE = 1e-5


def reference_difference(new_bytes, old_bytes):
    """The worst difference of two reference files relative to each tensor's largest
    magnitude, or None when they do not hold the same tensors, or their integer tensors differ."""
    import numpy as np
    from safetensors.numpy import load
    a, b = load(new_bytes), load(old_bytes)
    if sorted(a) != sorted(b):
        return None
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return None
        if not np.issubdtype(x.dtype, np.floating):
            if not np.array_equal(x, y):
                return None
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-30)
        worst = max(worst, float(np.max(np.abs(x - y))) / scale if y.size else 0.0)
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Write transformers reference fixtures for libkt's tests "
                    "(tiny random models, forward + backward). See tests/hf/README.md.")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"),
                    help="output directory (default: tests/hf/fixtures next to this script)")
    ap.add_argument("--arch", action="append", choices=ALL, metavar="NAME",
                    help="regenerate only this fixture (repeatable): " + ", ".join(ALL))
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out: "
                         "byte for byte, except that the outputs transformers computed may "
                         "differ by 1e-5 of each tensor's largest (another CPU's rounding); "
                         "exit 0 reproduced, 1 different, 77 (skip) without torch")
    args = ap.parse_args(argv)
    try:
        import_stack()
    except ImportError as e:
        print("make_fixtures: %sneeds torch, transformers, peft, safetensors: %s"
              % ("skipped: " if args.check else "", e), file=sys.stderr)
        return 77 if args.check else 2
    todo = args.arch or ALL
    if args.check:
        return check(args.out, todo)
    os.makedirs(args.out, exist_ok=True)
    for d in generate(args.out, todo):
        print("wrote", d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
