#!/usr/bin/env bash
# kt-generate on a small model that kt-train trained for a few steps and saved:
#  (a) the logits of the decode steps (the key/value cache, --dump-logits) equal those of the
#      training program's forward over the whole sequence (kt-run, no cache) within 1e-5 of
#      the largest logit, for a greedy and a sampled sequence, the context filled to its end;
#  (b) each greedy token is the argmax of the full forward's logits before it;
#  (c) sampling: the same seed gives the same tokens, other seeds others; top-k 1, top-p
#      near 0 and temperature near 0 give the greedy tokens; top-k / top-p samples lie in the
#      set they allow (against the full forward's logits); the text output is the ids'
#      bytes, escaped;
#  (d) bad input: a prompt longer than the context, an id outside the vocabulary, a checkpoint
#      of another shape (a missing, misshapen or extra tensor, named), a program that is no
#      decode program, bad flag values: exit 1 or 2 with a message, no output file.
#
# usage: test_kt_generate.sh KT_GRAPHC KT_TRAIN KT_RUN KT_GENERATE ST_COMPARE SOURCE_DIR WORKDIR
set -uo pipefail
graphc=$1 train=$2 run=$3 gen=$4 compare=$5 src=$6 dir=$7
check="$src/tests/generate/check_generate.py"
command -v python3 > /dev/null || { echo "SKIP: no python3 (reads the logits files)"; exit 77; }
rm -rf "$dir" && mkdir -p "$dir" || exit 1
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# The model: examples/moe_lm.ktg, the training twin of examples/moe_lm_decode.ktg, at test
# sizes (its full forward over C tokens is the reference; segments all 0: one document).
C=24 INTER=16
sizes=(-D VOCAB=256 -D H=32 -D HQ=4 -D HKV=2 -D D=8 -D E=4 -D TOPK=2 -D L=2 -D INTER=$INTER)
model="$src/examples/moe_lm.ktg"
"$graphc" "$model" "${sizes[@]}" -D B=2 -D T=16 -o "$dir/train.ktp" > /dev/null &&
  "$graphc" "$model" "${sizes[@]}" -D B=1 -D T=$C -o "$dir/full.ktp" > /dev/null ||
  { echo "FAIL: $model does not compile"; exit 1; }
decode="$src/examples/moe_lm_decode.ktg"
"$graphc" "$decode" "${sizes[@]}" -D C=$C -o "$dir/decode.ktp" > /dev/null ||
  { echo "FAIL: $decode does not compile"; exit 1; }
cat "$src"/docs/*.md > "$dir/text.bin"
"$train" "$dir/train.ktp" --data "$dir/text.bin" --data-format u8 --steps 3 --lr 0.01 \
  --save "$dir/ckpt.safetensors" --run-dir "$dir/trained" --threads 2 \
  > "$dir/train.log" 2>&1 ||
  { echo "FAIL: kt-train: $(tail -n 2 "$dir/train.log")"; exit 1; }
ckpt="$dir/ckpt.safetensors"

# The description (kt-generate compiles it twice: the prompt in one forward, then one token a
# step), or the compiled program (the prompt one token a step too).
described=("$decode" "${sizes[@]}" -D C=$C)
prog=("${described[@]}")
# generate NAME kt-generate-arguments...: the ids on $dir/NAME.ids, stderr on NAME.err
generate() {
  local name=$1
  shift
  "$gen" "${prog[@]}" --params "$ckpt" --threads 2 --ids "$@" \
    > "$dir/$name.ids" 2> "$dir/$name.err" ||
    { fail "$name: kt-generate exited $?: $(cat "$dir/$name.err")"; return 1; }
}
# full NAME: the training program's forward over the tokens NAME's dump fed
full() {
  python3 "$check" inputs "$dir/$1.dump" "$dir/$1.in" --segments &&
    "$run" "$dir/full.ktp" --params "$ckpt" --inputs "$dir/$1.in" --out "$dir/$1.full" \
      --moe-mode frozen --threads 2 2> "$dir/$1.run.err" ||
    { fail "$1: the full forward: $(cat "$dir/$1.run.err")"; return 1; }
}

prompt=84,104,101,32,71  # "The G"
P=5 MAXNEW=$((C - 5 + 1))   # the context filled: the last new token is never fed
# (a) + (b) greedy
if generate greedy --prompt-ids $prompt --greedy --max-new $MAXNEW \
     --dump-logits "$dir/greedy.dump" && full greedy; then
  "$compare" "$dir/greedy.full" "$dir/greedy.dump" --select logits --logits 1e-5 ||
    fail "greedy: the decode steps' logits differ from the full forward's"
  python3 "$check" greedy "$dir/greedy.full" $P "$(cat "$dir/greedy.ids")" ||
    fail "greedy: a token is not the full forward's argmax"
  [ "$(tr ',' '\n' < "$dir/greedy.ids" | grep -c .)" -eq $MAXNEW ] ||
    fail "greedy: $(cat "$dir/greedy.ids") is not $MAXNEW tokens"
fi
# (a) + (b) the prompt one token a step (a compiled program)
prog=("$dir/decode.ktp")
if generate stepwise --prompt-ids $prompt --greedy --max-new $MAXNEW \
     --dump-logits "$dir/stepwise.dump" && full stepwise; then
  "$compare" "$dir/stepwise.full" "$dir/stepwise.dump" --select logits --logits 1e-5 ||
    fail "stepwise: the decode steps' logits differ from the full forward's"
  python3 "$check" greedy "$dir/stepwise.full" $P "$(cat "$dir/stepwise.ids")" ||
    fail "stepwise: a token is not the full forward's argmax"
fi
prog=("${described[@]}")
# (a) a prompt that fills the context: all but its last token in one forward
whole=$(seq -s, 40 $((40 + C - 1)))
if generate whole --prompt-ids "$whole" --greedy --max-new 1 --dump-logits "$dir/whole.dump" &&
   full whole; then
  "$compare" "$dir/whole.full" "$dir/whole.dump" --select logits --logits 1e-5 ||
    fail "whole: the prompt's logits differ from the full forward's"
  python3 "$check" greedy "$dir/whole.full" $C "$(cat "$dir/whole.ids")" ||
    fail "whole: the token is not the full forward's argmax"
fi
# (a) on a sampled sequence, and its tokens within the top-k 5 / top-p 0.9 set
if generate sampled --prompt-ids $prompt --top-k 5 --top-p 0.9 --seed 7 --max-new $MAXNEW \
     --dump-logits "$dir/sampled.dump" && full sampled; then
  "$compare" "$dir/sampled.full" "$dir/sampled.dump" --select logits --logits 1e-5 ||
    fail "sampled: the decode steps' logits differ from the full forward's"
  python3 "$check" within "$dir/sampled.full" $P "$(cat "$dir/sampled.ids")" 5 0.9 ||
    fail "sampled: a token outside what top-k 5 and top-p 0.9 allow"
  cmp -s "$dir/sampled.ids" "$dir/greedy.ids" && fail "sampled: the same tokens as greedy"
fi
# top-p alone, on the model's own distribution
if generate nucleus --prompt-ids $prompt --top-p 0.5 --seed 3 --max-new $MAXNEW \
     --dump-logits "$dir/nucleus.dump" && full nucleus; then
  python3 "$check" within "$dir/nucleus.full" $P "$(cat "$dir/nucleus.ids")" 0 0.5 ||
    fail "nucleus: a token outside the top-p 0.5 set"
fi

# (c) seeds: the same twice; three seeds at least two sequences
for s in 1 2 3; do generate seed$s --prompt "The " --seed $s --max-new 16; done
generate seed1_again --prompt "The " --seed 1 --max-new 16
cmp -s "$dir/seed1.ids" "$dir/seed1_again.ids" || fail "seed 1 twice gave different tokens"
[ "$(cat "$dir"/seed{1,2,3}.ids | sort -u | wc -l)" -ge 2 ] ||
  fail "seeds 1, 2 and 3 gave the same tokens"
echo "ok: seeds: seed 1 twice $(cat "$dir/seed1.ids"); seed 2 $(cat "$dir/seed2.ids")"
# the greedy limits
for how in "--top-k 1" "--temperature 1e-6" "--top-p 1e-9" "--temperature 0"; do
  name=limit_${how// /_}
  generate "$name" --prompt-ids $prompt --max-new $MAXNEW --seed 5 $how &&
    { cmp -s "$dir/$name.ids" "$dir/greedy.ids" || fail "$how: not the greedy tokens"; }
done
# text output: the ids' bytes, escaped where not printable
"$gen" "${described[@]}" --params "$ckpt" --threads 2 --prompt-ids $prompt --max-new $MAXNEW \
  --seed 9 > "$dir/text.out" 2> "$dir/text.err" || fail "text: exit $?: $(cat "$dir/text.err")"
generate text_ids --prompt-ids $prompt --max-new $MAXNEW --seed 9
python3 "$check" text "$(cat "$dir/text_ids.ids")" > "$dir/text.want"
cmp -s "$dir/text.out" "$dir/text.want" ||
  fail "text: '$(cat "$dir/text.out")' is not the ids' bytes '$(cat "$dir/text.want")'"
grep -q "generated: $MAXNEW tokens in .* tokens/s" "$dir/text.err" ||
  fail "text: no speed line on stderr: $(cat "$dir/text.err")"
grep -q "prompt: $P tokens in" "$dir/text.err" || fail "text: no prompt speed line"
# --eos: stops after that id
first=$(cut -d, -f1 "$dir/greedy.ids")
generate eos --prompt-ids $prompt --greedy --eos "$first"
[ "$(cat "$dir/eos.ids")" = "$first" ] || fail "--eos $first: got $(cat "$dir/eos.ids")"
echo "ok: top-k 1, temperature and top-p near 0 give the greedy tokens; text, --eos"
# --params a kt-train run directory: its newest checkpoint (an older one here is no model)
mkdir -p "$dir/run/step-00000002" "$dir/run/step-00000001" "$dir/run/.step-00000003.tmp.1"
cp "$ckpt" "$dir/run/step-00000002/session.safetensors"
cp "$dir/text.bin" "$dir/run/step-00000001/session.safetensors"
cp "$dir/text.bin" "$dir/run/.step-00000003.tmp.1/session.safetensors"
for where in run run/step-00000002; do
  name=rundir_${where//\//_}
  "$gen" "${prog[@]}" --params "$dir/$where" --threads 2 --ids --prompt-ids $prompt --greedy \
    --max-new $MAXNEW > "$dir/$name.ids" 2> "$dir/$name.err" ||
    fail "--params $where: exit $?: $(cat "$dir/$name.err")"
  grep -q "the checkpoint .*run/step-00000002/session\.safetensors" "$dir/$name.err" ||
    fail "--params $where: not the newest checkpoint: $(cat "$dir/$name.err")"
  cmp -s "$dir/$name.ids" "$dir/greedy.ids" || fail "--params $where: not the greedy tokens"
done
echo "ok: --params a run directory or a checkpoint directory: step-00000002/session.safetensors"
# and the run directory kt-train wrote: the same model as its --save
generate trained --params "$dir/trained" --prompt-ids $prompt --greedy --max-new $MAXNEW &&
  { cmp -s "$dir/trained.ids" "$dir/greedy.ids" ||
      fail "--params kt-train's run directory: not the tokens of its --save"; }
grep -q "the checkpoint .*trained/step-00000003/session\.safetensors" "$dir/trained.err" ||
  fail "--params kt-train's run directory: $(cat "$dir/trained.err")"

# (d) expect NAME STATUS PATTERN kt-generate-arguments...
expect() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "$gen" "$@" > "$dir/$name.out" 2> "$dir/$name.err"
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    fail "$name: exit status $rc, expected $want: $(cat "$dir/$name.err")"
  elif ! grep -q -E -e "$pattern" "$dir/$name.err"; then
    fail "$name: stderr does not match '$pattern': $(cat "$dir/$name.err")"
  else
    echo "ok: $name: $(head -n 1 "$dir/$name.err")"
  fi
}
base=("$dir/decode.ktp" --params "$ckpt" --threads 1)
long=$(printf 'x%.0s' $(seq 1 $((C + 1))))
expect long_prompt 1 "the prompt is $((C + 1)) tokens, longer than the context of $C" \
  "${base[@]}" --prompt "$long" --dump-logits "$dir/bad.dump"
expect too_many_new 1 "--max-new $((MAXNEW + 1)): a prompt of $P tokens leaves room for $MAXNEW" \
  "${base[@]}" --prompt-ids $prompt --max-new $((MAXNEW + 1))
expect id_outside 1 "token 1 is id 256, outside the model's vocabulary \(0\.\.255\)" \
  "${base[@]}" --prompt-ids 1,256
expect eos_outside 1 "--eos 256 is outside the model's vocabulary" \
  "${base[@]}" --prompt-ids 1 --eos 256
"$graphc" "$decode" "${sizes[@]}" -D C=$C -D L=3 -o "$dir/decode_l3.ktp" > /dev/null
expect missing_tensor 1 "no tensor .*model\.layers\.2\..*" \
  "$dir/decode_l3.ktp" --params "$ckpt" --prompt-ids 1
"$graphc" "$decode" "${sizes[@]}" -D C=$C -D L=1 -o "$dir/decode_l1.ktp" > /dev/null
expect extra_tensor 1 "model\.layers\.1\..* is not a parameter" \
  "$dir/decode_l1.ktp" --params "$ckpt" --prompt-ids 1
expect misshapen 1 "cannot load the checkpoint: .*model\..*f32\[.*" \
  "$decode" "${sizes[@]}" -D C=$C -D H=48 --params "$ckpt" --prompt-ids 1
expect no_decode 1 "no input 'positions': it is not a decode program" \
  "$dir/full.ktp" --params "$ckpt" --prompt-ids 1
expect long_prompt_ktg 1 "the prompt is $((C + 1)) tokens, longer than the context of $C" \
  "${described[@]}" --params "$ckpt" --prompt "$long"
expect rope_table 1 "the context C = 5000 is longer than the program.s RoPE table" \
  "$decode" "${sizes[@]}" -D C=5000 --params "$ckpt" --prompt-ids 1
expect define_new 2 "-D NEW: kt-generate sets the tokens a step itself" \
  "${described[@]}" -D NEW=2 --params "$ckpt" --prompt-ids 1,2,3
"$graphc" "$decode" "${sizes[@]}" -D C=$C -D NEW=2 -o "$dir/decode_new2.ktp" \
  > /dev/null
expect new_two 1 "decode_new2\.ktp takes 2 tokens a step; kt-generate's steps take one" \
  "$dir/decode_new2.ktp" --params "$ckpt" --prompt-ids 1
expect define_ktp 2 "-D C: overrides apply to a \.ktg description" \
  "${base[@]}" -D C=8 --prompt-ids 1
expect define_unknown 1 "names no constant" \
  "$decode" -D NOPE=1 --params "$ckpt" --prompt-ids 1
expect top_p_zero 2 "--top-p needs a number > 0 and <= 1, not '0'" \
  "${base[@]}" --prompt a --top-p 0
expect top_p_big 2 "--top-p needs a number > 0 and <= 1, not '1.5'" \
  "${base[@]}" --prompt a --top-p 1.5
expect temperature 2 "--temperature needs a number >= 0 and <= 1e\+06, not '-1'" \
  "${base[@]}" --prompt a --temperature -1
expect top_k 2 "--top-k needs a whole number" "${base[@]}" --prompt a --top-k -3
expect max_new 2 "--max-new needs a whole number" "${base[@]}" --prompt a --max-new x
expect greedy_and_t 2 "--greedy .* does not go with" "${base[@]}" --prompt a --greedy --top-k 3
expect two_prompts 2 "give one of --prompt" "${base[@]}" --prompt a --prompt-ids 1
expect no_prompt 2 "give one of --prompt" "${base[@]}"
expect empty_prompt 2 "the prompt is empty" "${base[@]}" --prompt ""
expect bad_ids 2 "--prompt-ids needs token ids" "${base[@]}" --prompt-ids 1,,2
expect no_params 2 "--params is required" "$dir/decode.ktp" --prompt a
expect dump_is_params 2 "--dump-logits names the same file as --params" \
  "${base[@]}" --prompt a --dump-logits "$ckpt"
expect not_a_checkpoint 1 "cannot read the checkpoint" \
  "$dir/decode.ktp" --params "$dir/text.bin" --prompt a
[ -e "$dir/bad.dump" ] && fail "a refused run wrote its --dump-logits file"
"$gen" --help | grep -q -- "--top-p" || fail "--help does not mention --top-p"

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all kt-generate checks passed"
