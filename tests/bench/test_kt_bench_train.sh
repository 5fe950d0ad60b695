#!/usr/bin/env bash
# kt-bench train at tiny sizes without PyTorch: both configurations train through libkt (the
# main one on examples/qwen3_moe.ktg or moe_lm.ktg, the lora one on a checkpoint it writes and
# imports), their JSON has the issue's fields with values that follow from the model's sizes;
# the peer through a stand-in (fake_train_peer.py): the ratios are libkt's figures over its,
# a peer that cannot run leaves null ratios with a note; bad arguments exit 2.
#
# usage: test_kt_bench_train.sh KT_BENCH
set -uo pipefail
bench=$1
here=$(dirname "$0")
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
if ! command -v python3 >/dev/null; then
  echo "SKIP: python3 is needed to read the JSON lines" >&2
  exit 77
fi

out=$("$bench" train --help 2>&1) || fail "train --help exited $?"
grep -q "usage: kt-bench train" <<<"$out" || fail "train --help printed no usage"
for bad in "--config both" "--steps 0" "--config lora --ktg x.ktg" "--vocab 9" "--frob" \
           "--lora-shape huge" "--batch" "--torch-experts fast"; do
  "$bench" train $bad --no-peer > /dev/null 2>&1
  [ $? -eq 2 ] || fail "train $bad is not a usage error"
done

# check KIND: the JSON line's fields (KIND main or lora; PEER none, fake or gone)
check() {
  python3 -c '
import json, math, sys
kind, peer = sys.argv[1], sys.argv[2]
d = [json.loads(l) for l in sys.stdin.read().splitlines() if l.startswith("{")]
assert len(d) == 1, d
o = d[0]
c = o["config"]
assert o["bench"] == "train" and c["config"] == kind and c["optimizer"] == "adamw", c
for k in ("tokens_per_s", "torch_tokens_per_s", "ratio_vs_torch", "peak_rss_bytes",
          "torch_peak_rss_bytes"):
    assert k in o, "lacks " + k
assert o["tokens_per_s"] > 0 and math.isfinite(o["tokens_per_s"]), o
assert abs(o["tokens_per_s"] * o["step_ms"] / 1e3 - c["batch"] * c["seq"]) < 1e-2 * c["batch"] * c["seq"], o
assert o["peak_rss_bytes"] > 1e6, o
assert math.isfinite(o["loss_last"]), o
H, D, E, I, L, V = c["hidden"], c["head_dim"], c["experts"], c["intermediate"], c["layers"], c["vocab"]
HQ, HKV = c["heads"], c["kv_heads"]
per_layer = H * D * (2 * HQ + 2 * HKV) + 2 * D + 2 * H + E * H + E * 3 * H * I
assert c["params"] == 2 * V * H + L * per_layer + H, (c["params"], 2 * V * H + L * per_layer + H)
if kind == "main":
    assert (c["batch"], c["seq"], L) == (2, 16, 1), c
    assert o["trainable_params"] == c["params"], o  # full training
else:
    r = 8  # adapters on q, k, v, o and every expert gate, up and down
    attn = r * ((H + HQ * D) * 2 + (H + HKV * D) * 2)
    assert o["trainable_params"] == L * (attn + E * 3 * r * (H + I)), o
    assert c["dtype"] == "bf16" and c["moe_mode"] == "lora", c
if peer == "fake":
    assert o["torch_tokens_per_s"] == 100 and o["torch_trainable_params"] == 5, o
    assert abs(o["ratio_vs_torch"] - o["tokens_per_s"] / 100) < 1e-4 * o["ratio_vs_torch"], o
    assert o["torch_peak_rss_bytes"] > 1e6, o  # the process, measured by kt-bench
    want = o["peak_rss_bytes"] / o["torch_peak_rss_bytes"]
    assert abs(o["peak_rss_vs_torch"] - want) < 1e-4 * want, o
else:
    assert o["ratio_vs_torch"] is None and o["torch_tokens_per_s"] is None, o
    assert o["torch_peak_rss_bytes"] is None, o
    assert sys.argv[3] in o["note"], (o["note"], sys.argv[3])
' "$@"
}

main="--config main --batch 2 --seq 16 --layers 1 --steps 2 --warmup 1 --json"
out=$("$bench" train $main --no-peer 2>&1) || fail "train main exited $?: $out"
check main none "--no-peer" <<<"$out" || fail "train main JSON: $out"
out=$("$bench" train $main --torch-python /nonexistent/python 2>&1) ||
  fail "train main (no python) exited $?: $out"
check main gone "/nonexistent/python" <<<"$out" || fail "train main (no python) JSON: $out"
args=$(mktemp)
out=$(FAKE_TRAIN_PEER_ARGS=$args "$bench" train $main --torch-python python3 \
        --peer-script "$here/fake_train_peer.py" 2>&1) || fail "train main (stand-in peer) exited $?: $out"
check main fake <<<"$out" || fail "train main (stand-in peer) JSON: $out"
# the peer was given the model the program is: its sizes, batch, steps and threads
python3 -c '
import json, sys
a = json.load(open(sys.argv[1]))
o = [json.loads(l) for l in sys.stdin.read().splitlines() if l.startswith("{")][0]
c = o["config"]
want = {"--vocab": c["vocab"], "--hidden": c["hidden"], "--heads": c["heads"],
        "--kv-heads": c["kv_heads"], "--head-dim": c["head_dim"], "--experts": c["experts"],
        "--top-k": c["top_k"], "--inter": c["intermediate"], "--layers": c["layers"],
        "--batch": c["batch"], "--seq": c["seq"], "--steps": c["steps"], "--warmup": c["warmup"],
        "--threads": c["threads"]}
bad = {k: (a.get(k), v) for k, v in want.items() if a.get(k) != str(v)}
assert not bad, bad
assert float(a["--aux-coef"]) == 0.001 and a["--experts-impl"] == "grouped_mm", a
' "$args" <<<"$out" || fail "train main: the peer got other sizes than the model: $(cat "$args")"
rm -f "$args"
out=$(FAKE_TRAIN_PEER=77 "$bench" train $main --torch-python python3 \
        --peer-script "$here/fake_train_peer.py" 2>&1) || fail "train main (peer 77) exited $?: $out"
check main gone "exit 77" <<<"$out" || fail "train main (peer 77) JSON: $out"

lora="--config lora --lora-shape tiny --steps 2 --warmup 1 --json"
out=$("$bench" train $lora --no-peer 2>&1) || fail "train lora exited $?: $out"
check lora none "--no-peer" <<<"$out" || fail "train lora JSON: $out"
tmp=$(mktemp -d)
out=$(TMPDIR=$tmp "$bench" train $lora --torch-python python3 \
        --peer-script "$here/fake_train_peer.py" 2>&1) || fail "train lora (stand-in) exited $?: $out"
check lora fake <<<"$out" || fail "train lora (stand-in peer) JSON: $out"
[ -z "$(ls -A "$tmp")" ] || fail "train lora left files in TMPDIR: $(ls -A "$tmp")"
rm -rf "$tmp"

# the text report names both sides and the targets
out=$("$bench" train --config main --batch 2 --seq 16 --layers 1 --steps 2 --warmup 1 \
        --torch-python python3 --peer-script "$here/fake_train_peer.py" 2>&1) ||
  fail "train main (text) exited $?: $out"
grep -Eq "torch +100.0 tokens/s" <<<"$out" || fail "train main text: no torch line: $out"
grep -q "target >= 2.5" <<<"$out" || fail "train main text: no ratio line: $out"

[ "$failures" -eq 0 ] || { echo "$failures failure(s)" >&2; exit 1; }
echo "kt-bench train: all checks passed"
