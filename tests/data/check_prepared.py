#!/usr/bin/env python3
"""Checks kt-data's output exactly, with the standard library only (tests/data).

  check_prepared.py bytes OUT [--eos ID] [--paragraphs] [--heldout K] INPUT...
      OUT/train.safetensors and OUT/heldout.safetensors hold, between them, every document of
      the inputs (text files: their bytes; .jsonl: each line's prompt bytes with mask 0, then
      its response's with mask 1), each followed by the EOS when given, each once, in input
      order within a file; K documents held out; the metadata and the header layout right.
  check_prepared.py tokenizer OUT TOKENIZER_JSON EOS INPUT.jsonl
      the same for prompt/response pairs through a tokenizer.json (needs `tokenizers`): the
      prompt encoded with its special tokens, the response without, then EOS.
  check_prepared.py edit IN OUT (mask-length N | token I V)
      a copy of a prepared file with the mask's shape set to N, or token I set to V (the bad
      files kt-train must refuse).
  check_prepared.py docs OUT
      prints each split's documents as a JSON list of token lists (to compare two splits).
"""
import json
import os
import struct
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def read_st(path):
    """(metadata, {name: (dtype, shape, raw bytes)}, header text) with the format's layout
    checked: the header length, 8-byte alignment, the offsets covering the data exactly."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    if (8 + n) % 8:
        fail(f"{path}: the data section starts at {8 + n}, not 8-byte aligned")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    spans, out = [], {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        spans.append((b, e))
        out[name] = (t["dtype"], t["shape"], data[b:e])
    spans.sort()
    at = 0
    for b, e in spans:
        if b != at:
            fail(f"{path}: a gap or overlap at data byte {at}")
        at = e
    if at != len(data):
        fail(f"{path}: {len(data) - at} bytes after the last tensor")
    return meta, out, raw[8:8 + n]


def ints(raw, size):
    fmt = {1: "B", 4: "i"}[size]
    return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))


def split_docs(path):
    """The file's documents as (tokens, mask) pairs, with its metadata, after checking the
    tensors' dtypes, shapes and document numbering."""
    meta, t, _ = read_st(path)
    if set(t) != {"tokens", "loss_mask", "doc_index"}:
        fail(f"{path}: tensors {sorted(t)}")
    for name, dtype in (("tokens", "I32"), ("loss_mask", "U8"), ("doc_index", "I32")):
        if t[name][0] != dtype:
            fail(f"{path}: {name} is {t[name][0]}, not {dtype}")
    tokens = ints(t["tokens"][2], 4)
    mask = ints(t["loss_mask"][2], 1)
    docs = ints(t["doc_index"][2], 4)
    n = len(tokens)
    if [t[k][1] for k in ("tokens", "loss_mask", "doc_index")] != [[n]] * 3:
        fail(f"{path}: shapes {[t[k][1] for k in t]}, not [[{n}]] x 3")
    out = []
    for i, d in enumerate(docs):
        if d == len(out):
            out.append(([], []))
        elif d != len(out) - 1:
            fail(f"{path}: doc_index[{i}] is {d} after {len(out) - 1}: not 0, 1, 2, ...")
        out[d][0].append(tokens[i])
        out[d][1].append(mask[i])
    if meta.get("kt.format") != "kt-tokens-1":
        fail(f"{path}: kt.format {meta.get('kt.format')!r}")
    if meta.get("kt.documents") != str(len(out)):
        fail(f"{path}: kt.documents {meta.get('kt.documents')!r}, but {len(out)} documents")
    return meta, out


def check(out_dir, expected, heldout, vocab, tokenizer):
    """expected: [(tokens, mask, source bytes)] in input order."""
    got = {}
    for name in ("train", "heldout"):
        meta, docs = split_docs(os.path.join(out_dir, f"{name}.safetensors"))
        if meta.get("kt.vocab") != str(vocab) or meta.get("kt.tokenizer") != tokenizer:
            fail(f"{name}: kt.vocab {meta.get('kt.vocab')!r}, kt.tokenizer "
                 f"{meta.get('kt.tokenizer')!r}; expected {vocab}, {tokenizer!r}")
        got[name] = (meta, docs)
    if len(got["heldout"][1]) != heldout:
        fail(f"{len(got['heldout'][1])} documents held out, expected {heldout}")
    # each split is a subsequence of the expected documents; together they are all of them
    where = {}
    for name, (meta, docs) in got.items():
        at, source = 0, 0
        for tokens, mask in docs:
            while at < len(expected) and (expected[at][0], expected[at][1]) != (tokens, mask):
                at += 1
            if at == len(expected):
                fail(f"{name}: a document not in the input, or out of order: {tokens[:20]}")
            if at in where:
                fail(f"document {at} is in both splits")
            where[at] = name
            source += expected[at][2]
            at += 1
        if meta.get("kt.bytes") != str(source):
            fail(f"{name}: kt.bytes {meta.get('kt.bytes')!r}, its documents hold {source}")
    missing = [i for i in range(len(expected)) if i not in where]
    if missing:
        fail(f"documents {missing} are in neither split")
    n = sum(len(d[0]) for d in got["train"][1])
    print(f"ok: {len(expected)} documents ({heldout} held out), {n} training tokens, "
          f"exactly as expected")


def pairs(raw):
    """The prompt/response pairs of a .jsonl file's bytes, as kt-data documents them."""
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        obj = json.loads(line)
        p = obj.get("prompt", obj.get("instruction", ""))
        if "instruction" in obj and "prompt" not in obj and obj.get("input"):
            p += "\n\n" + obj["input"]
        yield p, obj.get("response", obj.get("output", ""))


def bytes_expected(inputs, eos, paragraphs):
    import re
    out = []
    tail = [eos] if eos is not None else []
    for path in inputs:
        raw = open(path, "rb").read()
        if path.endswith(".jsonl"):
            for p, r in pairs(raw):
                p, r = p.encode(), r.encode()
                out.append((list(p) + list(r) + tail, [0] * len(p) + [1] * (len(r) + len(tail)),
                            len(p) + len(r)))
        elif paragraphs:
            for para in re.split(rb"\n[ \t\r]*\n", raw):
                if para.strip():
                    out.append((list(para) + tail, [1] * (len(para) + len(tail)), len(para)))
        elif raw:
            out.append((list(raw) + tail, [1] * (len(raw) + len(tail)), len(raw)))
    return out


def tokenizer_expected(tokenizer_json, eos, path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    out = []
    for prompt, response in pairs(open(path, "rb").read()):
        p = tok.encode(prompt).ids
        r = tok.encode(response, add_special_tokens=False).ids + [eos]
        out.append((p + r, [0] * len(p) + [1] * len(r),
                    len(prompt.encode()) + len(response.encode())))
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return out, vocab


def edit(src, dst, what, a, b):
    meta, tensors, _ = read_st(src)
    if what == "mask-length":  # a valid safetensors file whose mask is one value short
        dtype, _, raw = tensors["loss_mask"]
        tensors["loss_mask"] = (dtype, [int(a)], raw[:int(a)])
    else:
        dtype, shape, raw = tensors["tokens"]
        raw = bytearray(raw)
        raw[4 * int(a):4 * int(a) + 4] = struct.pack("<i", int(b))
        tensors["tokens"] = (dtype, shape, bytes(raw))
    header, data = {"__metadata__": meta}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    open(dst, "wb").write(struct.pack("<Q", len(text)) + text + data)


def main(argv):
    cmd = argv[0]
    if cmd == "bytes":
        out, rest = argv[1], argv[2:]
        eos, paragraphs, heldout = None, False, 1
        while rest and rest[0].startswith("--"):
            if rest[0] == "--eos":
                eos, rest = int(rest[1]), rest[2:]
            elif rest[0] == "--heldout":
                heldout, rest = int(rest[1]), rest[2:]
            else:
                paragraphs, rest = True, rest[1:]
        vocab = max(256, eos + 1) if eos is not None else 256
        check(out, bytes_expected(rest, eos, paragraphs), heldout, vocab, "bytes")
    elif cmd == "tokenizer":
        out, tj, eos, path = argv[1], argv[2], int(argv[3]), argv[4]
        expected, vocab = tokenizer_expected(tj, eos, path)
        check(out, expected, 1, vocab, os.path.basename(tj))
    elif cmd == "edit":
        edit(argv[1], argv[2], argv[3], argv[4], argv[5] if len(argv) > 5 else None)
    elif cmd == "docs":
        for name in ("train", "heldout"):
            print(json.dumps([d[0] for d in split_docs(f"{argv[1]}/{name}.safetensors")[1]]))
    else:
        fail(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv[1:])
