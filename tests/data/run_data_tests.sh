#!/usr/bin/env bash
# kt-data and kt-train on its files, as a user runs them:
#   - bytes mode on a directory of text files (whole files, and paragraphs) and on prompt/
#     response JSON lines: both files' tokens, masks, documents and metadata exactly as the
#     inputs say (check_prepared.py, standard library only); the split is by documents, the
#     same for the same seed (byte for byte) and another for another seed
#   - the refusals: empty input, a line that is not JSON, not an object, without the keys, a
#     missing file, too few documents, a bad --eos or --heldout-fraction
#   - kt-train on the prepared file with a program taking segments (tests/data/segments_lm.ktg):
#     the loss falls; a program of a smaller vocabulary, a mask of the wrong length, an id out
#     of range, and packed documents without segments are refused with their reason
#   - with a Python that has `tokenizers` (KT_HF_PYTHON, else /work/venv-torch/bin/python):
#     the tokenizer path on a BPE trained here, at run time; skipped (said so) without one
#
# usage: run_data_tests.sh KT_DATA KT_GRAPHC KT_TRAIN WORKDIR [PYTHON]
set -uo pipefail
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
data=$(abs "$1") graphc=$(abs "$2") train=$(abs "$3") work=$4 cmake_py=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
check="python3 $here/check_prepared.py"
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
failures=0
ok() { echo "ok: $*"; }
fail() { failures=$((failures + 1)); echo "FAIL: $*"; }
# refuse WHAT EXPECTED_RC TEXT COMMAND...: exits EXPECTED_RC with TEXT in its message
refuse() {
  local what=$1 rc=$2 text=$3 out got
  shift 3
  out=$("$@" 2>&1); got=$?
  if [ "$got" -eq "$rc" ] && grep -qF -- "$text" <<< "$out"; then ok "$what: $out"
  else fail "$what: exit $got (expected $rc with '$text'): $out"; fi
}

# ---- the inputs ----------------------------------------------------------------------------------
mkdir -p text/sub
printf 'The first document.\nIt has two lines.\n' > text/a.txt
printf 'A second paragraph one.\n\nParagraph two,\n  indented.\n \nThree.' > text/sub/b.txt
for i in $(seq 1 6); do
  printf 'document %d: %s\n' "$i" "$(seq -s ' ' 1 "$i")" > "text/d$i.txt"
done
: > text/empty.txt
mkdir -p text/.git && echo 'not a document' > text/.git/HEAD && echo 'nor this' > text/.hidden
{
  echo '{"prompt": "Q: 2+2?\nA:", "response": " 4"}'
  echo
  echo '{"prompt": "Say hi.", "response": "hi \u00e9t\u00e9"}'
  echo '{"instruction": "Add.", "input": "1 and 2", "output": "3"}'
  echo '{"instruction": "Name a colour.", "output": "red"}'
  echo '{"prompt": "", "response": "no prompt at all"}'
} > pairs.jsonl

# ---- bytes mode: exact contents ------------------------------------------------------------------
texts=(text/a.txt text/d1.txt text/d2.txt text/d3.txt text/d4.txt text/d5.txt text/d6.txt
       text/empty.txt text/sub/b.txt) # the directory's files in sorted order, not the hidden
if "$data" text -o out_text > text.log 2>&1; then
  out=$($check bytes out_text --heldout 1 "${texts[@]}") && ok "text files: $out" ||
    fail "text files: $out"
  grep -q "skipped 1 empty file" text.log && ok "the empty file is said to be skipped" ||
    fail "no word of the empty file: $(cat text.log)"
else fail "kt-data text: $(cat text.log)"; fi
if "$data" text -o out_para --split-on-blank-lines --eos 256 --heldout-fraction 0.3 --seed 7 \
     > para.log 2>&1; then
  out=$($check bytes out_para --eos 256 --paragraphs --heldout 3 "${texts[@]}") &&
    ok "paragraphs, EOS 256: $out" || fail "paragraphs: $out"
else fail "kt-data paragraphs: $(cat para.log)"; fi
if "$data" pairs.jsonl -o out_pairs --eos 10 > pairs.log 2>&1; then
  out=$($check bytes out_pairs --eos 10 --heldout 1 pairs.jsonl) && ok "prompt/response: $out" ||
    fail "prompt/response: $out"
  grep -q "heldout.safetensors: 1 document, " pairs.log && grep -q " masked), " pairs.log &&
    grep -q "bytes per token" pairs.log && ok "the summary: $(head -1 pairs.log)" ||
    fail "the summary: $(cat pairs.log)"
else fail "kt-data pairs: $(cat pairs.log)"; fi

# the output inside the input directory: a second run does not read the first one's files
"$data" text -o text/prep > /dev/null 2>&1 && "$data" text -o text/prep > /dev/null 2>&1 &&
  out=$($check bytes text/prep --heldout 1 "${texts[@]}") &&
  ok "hidden files and the output directory are left out: $out" ||
  fail "an output directory inside the input: ${out:-kt-data failed}"
rm -rf text/prep

# the split: the same seed gives the same files, byte for byte; another seed other documents
"$data" text -o out_text2 > /dev/null 2>&1 &&
  cmp -s out_text/train.safetensors out_text2/train.safetensors &&
  cmp -s out_text/heldout.safetensors out_text2/heldout.safetensors &&
  ok "the same seed: the same files" || fail "the same seed gave other files"
differs=0
for seed in 2 3 4 5; do
  "$data" text -o "out_seed$seed" --seed "$seed" > /dev/null 2>&1 || fail "kt-data --seed $seed"
  $check bytes "out_seed$seed" --heldout 1 "${texts[@]}" > /dev/null || fail "seed $seed: contents"
  [ "$($check docs "out_seed$seed" | tail -1)" != "$($check docs out_text | tail -1)" ] &&
    differs=1
done
[ "$differs" -eq 1 ] && ok "other seeds hold out other documents" ||
  fail "four other seeds all held out the same document"

# ---- refusals ------------------------------------------------------------------------------------
mkdir -p none && : > none/e.txt
refuse "empty input" 1 "the input is empty" "$data" none -o out_bad
printf '{"prompt": "a", "response": "b"}\n{"prompt": "a" "response": "b"}\n' > badjson.jsonl
refuse "a line that is not JSON" 1 "badjson.jsonl:2: not JSON" "$data" badjson.jsonl -o out_bad
printf '{"prompt": "a", "response": "b"}\n\n[1, 2]\n' > list.jsonl
refuse "a line that is not an object" 1 "list.jsonl:3: an array, not an object" \
  "$data" list.jsonl -o out_bad
printf '{"prompt": "a", "answer": "b"}\n' > keys.jsonl
refuse "an object without the keys" 1 'keys.jsonl:1: the object needs "prompt" and "response"' \
  "$data" keys.jsonl -o out_bad
printf '{"prompt": "a", "response": 7}\n' > type.jsonl
refuse "a response that is not a string" 1 'type.jsonl:1: "response" is a number' \
  "$data" type.jsonl -o out_bad
refuse "a missing file" 1 "nothere.txt: no such file" "$data" text/a.txt nothere.txt -o out_bad
if [ "$(id -u)" -ne 0 ]; then
  cp text/a.txt locked.txt && chmod 000 locked.txt
  refuse "an unreadable file" 1 "locked.txt: cannot read" "$data" locked.txt text/d1.txt -o out_bad
else
  echo "note: running as root, every file is readable: the unreadable-file case is not run"
fi
refuse "one document" 1 "holds 1 document: a held-out split needs at least 2" \
  "$data" text/a.txt -o out_bad
refuse "--eos past 2^31" 2 "not an id in [0, 2^31)" "$data" text -o out_bad --eos 2147483648
refuse "--heldout-fraction 1" 2 "is not in (0, 1)" "$data" text -o out_bad --heldout-fraction 1
refuse "no output directory" 2 "required" "$data" text
[ ! -e out_bad ] && ok "nothing written by a refused run" || fail "a refused run wrote out_bad"
"$data" --help | grep -q "prompt/response" && ok "--help" || fail "--help"

# ---- kt-train on the prepared files -------------------------------------------------------------
# a corpus that can be learnt: many short documents of a repeating sentence
mkdir -p corpus
for i in $(seq 1 40); do
  printf 'the cat sat on the mat. the cat sat on the mat. number %d\n' "$i" > "corpus/c$i.txt"
done
"$data" corpus -o prep --eos 256 > prep.log 2>&1 || fail "kt-data corpus: $(cat prep.log)"
"$graphc" "$here/segments_lm.ktg" -o seg.ktp -D VOCAB=257 -D T=32 -D H=32 > /dev/null &&
  "$graphc" "$here/segments_lm.ktg" -o seg128.ktp -D VOCAB=128 -D T=32 > /dev/null &&
  "$graphc" "$here/labels_lm.ktg" -o lab.ktp -D VOCAB=257 -D S=32 > /dev/null ||
  { echo "FAIL: kt-graphc"; exit 1; }
if "$train" seg.ktp --data prep/train.safetensors --steps 40 --lr 0.02 --threads 1 \
     --log-every 40 --losses losses.txt > train.log 2>&1; then
  first=$(head -1 losses.txt) last=$(tail -1 losses.txt)
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.6 * a) }' &&
    ok "kt-train on a prepared file: loss $first -> $last" ||
    fail "the loss did not fall below 0.6x: $first -> $last"
else fail "kt-train: $(cat train.log)"; fi
refuse "a smaller vocabulary" 1 "vocabulary of 257 (bytes), larger than the program's 128" \
  "$train" seg128.ktp --data prep/train.safetensors --steps 1
n=$(python3 -c "import json,struct,sys; f=open(sys.argv[1],'rb'); \
  print(json.loads(f.read(struct.unpack('<Q',f.read(8))[0]))['tokens']['shape'][0])" \
  prep/train.safetensors)
$check edit prep/train.safetensors short_mask.safetensors mask-length $((n - 1)) 2> /dev/null
refuse "a mask of the wrong length" 1 \
  "a mask of the wrong length: loss_mask holds $((n - 1)) values, tokens $n" \
  "$train" seg.ktp --data short_mask.safetensors --steps 1
$check edit prep/train.safetensors bad_id.safetensors token 1234 300
refuse "an id out of range" 1 "token 1234 (byte offset" \
  "$train" seg.ktp --data bad_id.safetensors --steps 1
refuse "packed documents without segments" 1 "has no 'segments' input" \
  "$train" lab.ktp --data prep/train.safetensors --steps 1
"$train" lab.ktp --data prep/train.safetensors --steps 2 --allow-cross-document --threads 1 \
  > allow.log 2>&1 && ok "--allow-cross-document trains it" ||
  fail "--allow-cross-document: $(cat allow.log)"

# ---- the tokenizer path --------------------------------------------------------------------------
py=""
for p in "${KT_HF_PYTHON:-}" "$cmake_py" /work/venv-torch/bin/python; do
  [ -n "$p" ] && command -v "$p" > /dev/null 2>&1 && "$p" -c "import tokenizers" 2> /dev/null &&
    { py=$p; break; }
done
if [ -z "$py" ]; then
  echo "skipped: the tokenizer path needs a Python with 'tokenizers' (set KT_HF_PYTHON);" \
       "the bytes mode above ran"
  [ "$failures" -eq 0 ] && exit 77 || exit 1
fi
"$py" - tok.json corpus/c1.txt pairs.jsonl <<'EOF' || fail "training a BPE"
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train(sys.argv[2:], trainer)
tok.save(sys.argv[1])
EOF
eos=$("$py" -c "from tokenizers import Tokenizer; import sys; \
  print(Tokenizer.from_file(sys.argv[1]).token_to_id('<|endoftext|>'))" tok.json)
if "$py" "$data" pairs.jsonl -o out_tok --tokenizer tok.json > tok.log 2>&1; then
  grep -q "(tok.json, vocabulary [0-9]*, EOS $eos)" tok.log ||
    fail "the summary names no tokenizer or EOS: $(cat tok.log)"
  out=$("$py" "$here/check_prepared.py" tokenizer out_tok tok.json "$eos" pairs.jsonl) &&
    ok "tokenizer.json, its <|endoftext|> ($eos) appended: $out" || fail "tokenizer: $out"
else fail "kt-data --tokenizer: $(cat tok.log)"; fi
printf 'caf\xe9\n' > latin1.txt
refuse "text that is not UTF-8" 1 "latin1.txt: byte 3: not UTF-8" \
  "$py" "$data" latin1.txt text/a.txt -o out_bad --tokenizer tok.json
refuse "--eos past the vocabulary" 1 "--eos 5000 is outside tok.json's vocabulary" \
  "$py" "$data" text -o out_bad --tokenizer tok.json --eos 5000
refuse "python3 without tokenizers" 1 "'tokenizers' is not installed" \
  env -i PATH=/usr/bin:/bin /usr/bin/python3 -S "$data" text -o out_bad --tokenizer tok.json

[ "$failures" -eq 0 ] && { echo "all passed"; exit 0; }
echo "$failures failed"
exit 1
