#!/usr/bin/env python3
"""kt-data: text files or prompt/response JSON lines -> kt-train's prepared token files.

Writes OUT/train.safetensors and OUT/heldout.safetensors, each holding the 1-D tensors
`tokens` (I32), `loss_mask` (U8: 1 where the token is a target that counts) and `doc_index`
(I32: the document each token belongs to, non-decreasing), with the metadata kt.format =
"kt-tokens-1", kt.bytes (the source bytes the tokens came from), kt.vocab (the tokenizer's
vocabulary size) and kt.tokenizer ("bytes" or the tokenizer file's name). docs/training.md,
"Preparing data", describes the format and how kt-train reads it.

Bytes mode needs only the standard library; --tokenizer needs the `tokenizers` package.
Exit status: 0 success, 1 error (one line "kt-data: ..." naming the file and line), 2 usage.
"""
import argparse
import array
import json
import os
import random
import re
import struct
import sys
import tempfile

PROG = "kt-data"
FORMAT = "kt-tokens-1"
MAX_ID = 2**31 - 1  # the ids are stored as I32
# special tokens that end a document, in the order they are looked for when neither --eos nor
# a tokenizer_config.json beside the tokenizer names one
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")


class DataError(Exception):
    """One line naming what and where; the tool prints it and exits 1."""


class UsageError(Exception):
    pass


# ---- the documents ---------------------------------------------------------------------------
# A document is (where it comes from, a list of (text, counts) parts): text as str (tokenizer)
# or bytes (bytes mode), counts 1 when its tokens are targets that count. A text document is
# one counted part; a prompt/response pair the prompt (not counted) and the response (counted).


def input_files(paths, out_dir):
    """The files named, and the regular files under the directories named (sorted, so that
    the same tree gives the same documents in the same order everywhere). Under a directory,
    hidden files and directories (.git) and the output directory are left out."""
    out, skip = [], os.path.realpath(out_dir)
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and
                                 os.path.realpath(os.path.join(root, d)) != skip)
                found.extend(os.path.join(root, f) for f in sorted(files)
                             if not f.startswith("."))
            found = [f for f in found if os.path.isfile(f)]
            if not found:
                raise DataError(f"{p}: the directory holds no files")
            out.extend(found)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    return out


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None


def decode(path, raw, line=None):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line}" if line else f"{path}: byte {e.start}"
        raise DataError(f"{where}: not UTF-8 text (a tokenizer reads text; bytes mode, "
                        f"without --tokenizer, takes any bytes)") from None


def text_documents(path, raw, as_bytes, paragraphs):
    """A file as one document, or one per paragraph (runs of lines between blank lines)."""
    body = raw if as_bytes else decode(path, raw)
    if not paragraphs:
        return [(path, [(body, 1)])] if body else []
    blank = rb"\n[ \t\r]*\n" if as_bytes else r"\n[ \t\r]*\n"
    paras = [p for p in re.split(blank, body) if p.strip()]
    return [(f"{path}: paragraph {k + 1}", [(p, 1)]) for k, p in enumerate(paras)]


def json_type(v):
    """JSON's name for a parsed value's type."""
    return {str: "a string", list: "an array", dict: "an object", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(v), "null")


def pair_field(obj, keys, path, line):
    for k in keys:
        if k in obj:
            v = obj[k]
            if not isinstance(v, str):
                raise DataError(f"{path}:{line}: \"{k}\" is {json_type(v)}, not a string")
            return v
    return None


def jsonl_documents(path, raw, as_bytes):
    """One prompt/response pair per line: {"prompt": ..., "response": ...}, or Alpaca's
    {"instruction": ..., "input": ..., "output": ...} (a non-empty input follows the
    instruction after a blank line). Blank lines are skipped."""
    docs = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        text = decode(path, line, n)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{n}: {json_type(obj)}, not an object with "
                            f"\"prompt\" and \"response\"")
        prompt = pair_field(obj, ("prompt", "instruction"), path, n)
        response = pair_field(obj, ("response", "output"), path, n)
        if prompt is None or response is None:
            raise DataError(f"{path}:{n}: the object needs \"prompt\" and \"response\" (or "
                            f"\"instruction\" and \"output\"); it has "
                            f"{', '.join(sorted(obj)) or 'no keys'}")
        if "instruction" in obj and "prompt" not in obj:
            extra = pair_field(obj, ("input",), path, n)
            if extra:
                prompt = prompt + "\n\n" + extra
        if as_bytes:
            prompt, response = prompt.encode("utf-8"), response.encode("utf-8")
        docs.append((f"{path}:{n}", [(prompt, 0), (response, 1)]))
    return docs


def read_documents(args):
    docs, skipped = [], 0
    for path in input_files(args.inputs, args.out):
        raw = read_bytes(path)
        kind = args.format
        if kind == "auto":
            kind = "jsonl" if path.endswith(".jsonl") else "text"
        if kind == "jsonl":
            found = jsonl_documents(path, raw, args.tokenizer is None)
        else:
            found = text_documents(path, raw, args.tokenizer is None, args.split_on_blank_lines)
        skipped += not found
        docs.extend(found)
    return docs, skipped


# ---- tokenizers --------------------------------------------------------------------------------


class ByteTokens:
    name = "bytes"

    def __init__(self, eos):
        self.eos = eos
        self.vocab = max(256, eos + 1) if eos is not None else 256

    def encode(self, part, first):
        return list(part)


class HfTokens:
    def __init__(self, path, eos):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"--tokenizer {path}: the Python package 'tokenizers' is not "
                            f"installed (pip install tokenizers), or use bytes mode") from None
        if not os.path.isfile(path):
            raise DataError(f"--tokenizer {path}: no such file")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the package raises its own exception types
            raise DataError(f"--tokenizer {path}: cannot load: {e}") from None
        self.name = os.path.basename(path)
        ids = self.tok.get_vocab(with_added_tokens=True).values()
        self.vocab = max(max(ids, default=-1) + 1, self.tok.get_vocab_size(with_added_tokens=True))
        self.eos = self.find_eos(path) if eos is None else eos
        if self.eos is not None and self.eos >= self.vocab:
            raise DataError(f"--eos {self.eos} is outside {self.name}'s vocabulary of "
                            f"{self.vocab}")

    def find_eos(self, path):
        """tokenizer_config.json's eos_token beside the file, else a usual EOS token."""
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        names = list(EOS_NAMES)
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (OSError, ValueError, AttributeError) as e:
                raise DataError(f"{config}: cannot read eos_token: {e}") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names = [eos]
        for n in names:
            i = self.tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, part, first):
        # special tokens (a BOS) only at the start of a document, not before a response
        return self.tok.encode(part, add_special_tokens=first).ids


# ---- the split and the files -------------------------------------------------------------------


def split_documents(n, fraction, seed):
    """Held-out document indices: round(fraction * n), at least 1 and at most n - 1, drawn by
    the seed (Python's Mersenne Twister: the same on every machine)."""
    if n < 2:
        raise DataError(f"the input holds {n} document{'s' if n != 1 else ''}: a held-out "
                        f"split needs at least 2 (one each side); add text, or use "
                        f"--split-on-blank-lines for paragraphs")
    k = min(max(1, round(fraction * n)), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return set(order[:k])


class Split:
    def __init__(self):
        self.tokens = array.array("i")
        self.mask = bytearray()
        self.docs = array.array("i")
        self.n_docs = self.source_bytes = 0

    def add(self, doc, tokenizer):
        where, doc = doc
        start = len(self.tokens)
        for k, (part, counts) in enumerate(doc):
            ids = tokenizer.encode(part, k == 0)
            self.source_bytes += len(part if isinstance(part, bytes) else part.encode("utf-8"))
            self.append(ids, counts, where)
        if tokenizer.eos is not None:
            self.append([tokenizer.eos], 1, where)
        if len(self.tokens) > start:
            self.docs.extend([self.n_docs] * (len(self.tokens) - start))
            self.n_docs += 1

    def append(self, ids, counts, where):
        for i in ids:
            if not 0 <= i <= MAX_ID:
                raise DataError(f"{where}: token id {i} does not fit the file's I32 ids")
        self.tokens.extend(ids)
        self.mask.extend(bytes([counts]) * len(ids))


def safetensors_bytes(split, tokenizer):
    n = len(split.tokens)
    tokens, docs = array.array("i", split.tokens), array.array("i", split.docs)
    if sys.byteorder == "big":
        tokens.byteswap()
        docs.byteswap()
    header = {
        "__metadata__": {"kt.format": FORMAT, "kt.bytes": str(split.source_bytes),
                         "kt.vocab": str(tokenizer.vocab), "kt.tokenizer": tokenizer.name,
                         "kt.documents": str(split.n_docs)},
        "tokens": {"dtype": "I32", "shape": [n], "data_offsets": [0, 4 * n]},
        "doc_index": {"dtype": "I32", "shape": [n], "data_offsets": [4 * n, 8 * n]},
        "loss_mask": {"dtype": "U8", "shape": [n], "data_offsets": [8 * n, 9 * n]},
    }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + tokens.tobytes() + docs.tobytes() + \
        bytes(split.mask)


def write_atomically(out_dir, files):
    """Every file to a temporary beside it first, then renamed over: a failure leaves the
    previous files as they were."""
    temps = []
    try:
        for name, data in files:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for (name, _), tmp in zip(files, temps):
            os.replace(tmp, os.path.join(out_dir, name))
        temps = []
    except OSError as e:
        raise DataError(f"cannot write {out_dir}: {e.strerror}") from None
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def summary(name, split, tokenizer):
    n = len(split.tokens)
    counted = sum(split.mask)
    per = split.source_bytes / n if n else 0.0
    docs = f"{split.n_docs} document{'s' if split.n_docs != 1 else ''}"
    eos = f"EOS {tokenizer.eos}" if tokenizer.eos is not None else "no EOS"
    print(f"{PROG}: {name}: {docs}, {n} tokens ({counted} counted, {n - counted} masked), "
          f"{split.source_bytes} bytes, {per:.3f} bytes per token ({tokenizer.name}, "
          f"vocabulary {tokenizer.vocab}, {eos})")


# ---- the command line --------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turns text files, or JSON lines of prompt/response pairs, into kt-train's "
                    "prepared token files: OUT/train.safetensors and OUT/heldout.safetensors "
                    "(tokens, loss_mask, doc_index; see docs/training.md).",
        epilog="inputs: files, or directories (every file under them in sorted order, but "
               "hidden ones and OUT). "
               "A .jsonl file holds one JSON object a line, {\"prompt\": ..., \"response\": ...} "
               "or {\"instruction\": ..., \"input\": ..., \"output\": ...}: the prompt's "
               "tokens get loss_mask 0, the response's (and its EOS) 1. Any other file is "
               "text: one document (or one per paragraph with --split-on-blank-lines), every "
               "token counted.\n\nExit status: 0 success, 1 error, 2 usage error.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text or .jsonl files, or dirs")
    p.add_argument("-o", "--out", required=True, metavar="DIR",
                   help="output directory (created if absent)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a Hugging Face tokenizer.json (needs the 'tokenizers' package); "
                        "default: bytes (vocabulary 256)")
    p.add_argument("--eos", metavar="ID",
                   help="token appended to every document: an id, or 'none'; default: the "
                        "tokenizer's EOS (tokenizer_config.json's eos_token beside it, else "
                        "<|endoftext|>, </s>, ...), none in bytes mode (--eos 256 makes the "
                        "vocabulary 257)")
    p.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="how to read the inputs (default auto: .jsonl files as JSON lines)")
    p.add_argument("--split-on-blank-lines", action="store_true",
                   help="text: every paragraph (lines between blank lines) is a document")
    p.add_argument("--heldout-fraction", type=float, default=0.05, metavar="F",
                   help="fraction of the documents held out, in (0, 1) (default 0.05; at "
                        "least one document each side)")
    p.add_argument("--seed", type=int, default=1, metavar="S",
                   help="which documents are held out (default 1)")

    def error(message):
        raise UsageError(message)

    p.error = error
    a = p.parse_args(argv)
    if not 0.0 < a.heldout_fraction < 1.0:
        raise UsageError(f"--heldout-fraction {a.heldout_fraction} is not in (0, 1)")
    if a.eos is None or a.eos == "none":
        a.eos_id = None
    else:
        try:
            a.eos_id = int(a.eos)
        except ValueError:
            raise UsageError(f"--eos needs a token id or 'none', not '{a.eos}'") from None
        if not 0 <= a.eos_id <= MAX_ID:
            raise UsageError(f"--eos {a.eos} is not an id in [0, 2^31)")
    a.no_eos = a.eos == "none"
    return a


def run(a):
    if a.tokenizer is None:
        tokenizer = ByteTokens(a.eos_id)
    else:
        tokenizer = HfTokens(a.tokenizer, a.eos_id)
        if a.no_eos:
            tokenizer.eos = None
    docs, skipped = read_documents(a)
    if not docs:
        raise DataError(f"{', '.join(a.inputs)}: no text: the input is empty")
    heldout = split_documents(len(docs), a.heldout_fraction, a.seed)
    splits = {"train": Split(), "heldout": Split()}
    for i, doc in enumerate(docs):
        splits["heldout" if i in heldout else "train"].add(doc, tokenizer)
    for name, s in splits.items():
        if len(s.tokens) == 0:
            raise DataError(f"the {name} split holds no tokens (its documents are empty)")
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create {a.out}: {e.strerror}") from None
    write_atomically(a.out, [(f"{name}.safetensors", safetensors_bytes(s, tokenizer))
                             for name, s in splits.items()])
    for name, s in splits.items():
        summary(f"{a.out}/{name}.safetensors", s, tokenizer)
    if skipped:
        print(f"{PROG}: skipped {skipped} empty file{'s' if skipped != 1 else ''}")


def main(argv):
    try:
        run(parse_args(argv))
    except UsageError as e:
        print(f"{PROG}: {e} (see --help)", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    try:
        sys.stdout.flush()
    except OSError as e:
        print(f"{PROG}: cannot write the summary: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
