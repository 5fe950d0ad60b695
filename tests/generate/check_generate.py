#!/usr/bin/env python3
"""kt-generate's checks that read safetensors (Debian's python3, no numpy or torch needed).

  check_generate.py inputs DUMP OUT [--segments]   kt-run's inputs for the tokens DUMP fed:
                                                   tokens i32 [1, n], targets [n] (zeros),
                                                   segments [1, n] (zeros) when asked
  check_generate.py inputs DUMP OUT --hf           the same for a kt-import program:
                                                   input_ids and labels i64 [1, n]
  check_generate.py greedy FULL PROMPT_LEN IDS     every generated id is the argmax of the
                                                   full forward's logits row before it
  check_generate.py within FULL PROMPT_LEN IDS K P every sampled id is within the top K
                                                   (0: all) and the top-P nucleus at T = 1
  check_generate.py text IDS                       the text kt-generate prints for the ids

IDS is a comma-separated list as kt-generate --ids prints it. Exit 1 with a message on a
failed check."""
import json
import math
import struct
import sys

FORMATS = {"F32": "f", "I32": "i", "I64": "q"}


def read(path):
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        lo, hi = v["data_offsets"]
        data = blob[8 + n + lo:8 + n + hi]
        fmt = FORMATS[v["dtype"]]
        count = len(data) // struct.calcsize(fmt)
        out[name] = (v["shape"], list(struct.unpack("<%d%s" % (count, fmt), data)))
    return out


def write(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, values) in tensors.items():
        data = struct.pack("<%d%s" % (len(values), FORMATS[dtype]), *values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def rows(path):
    shape, values = read(path)["logits"]
    width = shape[-1]
    return [values[i:i + width] for i in range(0, len(values), width)]


def ids(text):
    return [int(x) for x in text.split(",") if x != ""]


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def cmd_inputs(dump, out, *flags):
    tokens = read(dump)["tokens"][1]
    n = len(tokens)
    if "--hf" in flags:
        write(out, {"input_ids": ("I64", [1, n], tokens), "labels": ("I64", [1, n], tokens)})
        return
    t = {"tokens": ("I32", [1, n], tokens), "targets": ("I32", [n], [0] * n)}
    if "--segments" in flags:
        t["segments"] = ("I32", [1, n], [0] * n)
    write(out, t)


def cmd_greedy(full, prompt_len, text):
    logits, got = rows(full), ids(text)
    first = int(prompt_len) - 1
    close = 0
    for i, g in enumerate(got):
        row = logits[first + i]
        best = max(range(len(row)), key=lambda j: (row[j], -j))
        ranked = sorted(row, reverse=True)
        if ranked[0] - ranked[1] < 1e-4:  # a near tie: either is the argmax within rounding
            close += 1
            if row[g] < ranked[0] - 1e-4:
                fail("token %d: %d, but the full forward's argmax is %d" % (i, g, best))
        elif g != best:
            fail("token %d: %d, but the full forward's argmax is %d (logit %.6g against %.6g)"
                 % (i, g, best, row[best], row[g]))
    if len(got) < 1:
        fail("only %d tokens to check" % len(got))
    print("ok: %d greedy tokens are the full forward's argmax (%d near ties)" % (len(got), close))


def cmd_within(full, prompt_len, text, k, p):
    logits, got = rows(full), ids(text)
    k, p = int(k), float(p)
    first = int(prompt_len) - 1
    outside = 0
    for i, g in enumerate(got):
        row = logits[first + i]
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))
        if k > 0:
            order = order[:k]
        top = row[order[0]]
        prob = [math.exp(row[j] - top) for j in order]
        total, acc, keep = sum(prob), 0.0, []
        for j, q in zip(order, prob):
            keep.append(j)
            acc += q
            if acc >= p * total * (1 + 1e-9):
                break
        if g not in keep:
            outside += 1
            print("token %d: %d is not among the %d kept (%s...)" % (i, g, len(keep), keep[:5]),
                  file=sys.stderr)
    if outside:
        fail("%d of %d sampled tokens lie outside top-k %d / top-p %g" % (outside, len(got), k, p))
    print("ok: %d sampled tokens within top-k %d, top-p %g" % (len(got), k, p))


def cmd_text(text):
    out = []
    for i in ids(text):
        if i >= 256:
            out.append("\\{%d}" % i)
        elif i == 0x5C:
            out.append("\\\\")
        elif 0x20 <= i < 0x7F or i in (0x0A, 0x09):
            out.append(chr(i))
        else:
            out.append("\\x%02x" % i)
    sys.stdout.write("".join(out) + "\n")


if __name__ == "__main__":
    commands = {"inputs": cmd_inputs, "greedy": cmd_greedy, "within": cmd_within,
                "text": cmd_text}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        fail("usage: check_generate.py inputs|greedy|within|text ...")
    commands[sys.argv[1]](*sys.argv[2:])
