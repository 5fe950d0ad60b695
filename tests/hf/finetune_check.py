#!/usr/bin/env python3
"""The helpers of finetune_e2e.sh (Python with tokenizers; the last also torch, transformers
and peft).

  finetune_check.py tokenizer OUT.json VOCAB TEXT_FILE
      trains a character-level BPE of at most VOCAB ids on the text, <|endoftext|> among them
  finetune_check.py window PREPARED.safetensors B S OUT.safetensors
      the first window kt-train feeds from a prepared file to an [B, S] kt-import program:
      input_ids, and labels as the format's rules give them (-100 where loss_mask is 0 or a
      document starts), plus labels_all (every token counted), all I64; prints the counts
  finetune_check.py peft-loss MODEL_DIR ADAPTER_DIR WINDOW.safetensors KEY
      transformers + PEFT's loss on the window's input_ids with its labels KEY
"""
import json
import struct
import sys


def read_prepared(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]

    def tensor(name, fmt, size):
        b, e = header[name]["data_offsets"]
        return list(struct.unpack(f"<{(e - b) // size}{fmt}", data[b:e]))

    return tensor("tokens", "i", 4), tensor("loss_mask", "B", 1), tensor("doc_index", "i", 4)


def window(path, b, s, out):
    import numpy as np
    from safetensors.numpy import save_file
    tokens, mask, docs = read_prepared(path)
    n = b * s
    labels = [tokens[i] if mask[i] and i > 0 and docs[i] == docs[i - 1] else -100
              for i in range(n)]
    ids = np.array(tokens[:n], dtype=np.int64).reshape(b, s)
    save_file({"input_ids": ids, "labels": np.array(labels, dtype=np.int64).reshape(b, s),
               "labels_all": ids.copy()}, out)
    # the targets that count under shift_labels: positions 1.. of each row
    counted = sum(1 for i in range(n) if i % s and labels[i] != -100)
    print(f"{counted} of {n - b} targets counted")


def tokenizer(out, vocab, text):
    from tokenizers import Tokenizer, models, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  show_progress=False)
    tok.train([text], trainer)
    top = max(tok.get_vocab(with_added_tokens=True).values())
    if top >= vocab:
        sys.exit(f"the tokenizer has id {top}, not below {vocab}")
    tok.save(out)


def peft_loss(model_dir, adapter_dir, path, key):
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import check_hf
    check_hf.import_torch()
    import peft
    import torch
    from safetensors.torch import load_file
    w = load_file(path)
    model = peft.PeftModel.from_pretrained(check_hf.load_model(model_dir, "float32"),
                                           adapter_dir).eval()
    with torch.no_grad():
        print("%.9g" % model(input_ids=w["input_ids"], labels=w[key]).loss.item())


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] == "tokenizer":
        tokenizer(a[1], int(a[2]), a[3])
    elif a[0] == "window":
        window(a[1], int(a[2]), int(a[3]), a[4])
    elif a[0] == "peft-loss":
        peft_loss(a[1], a[2], a[3], a[4])
    else:
        sys.exit(f"unknown command {a[0]}")
