#!/usr/bin/env python3
"""The file generator of tests/fault_matrix.sh (python3 standard library only).

    fault_matrix_gen.py ktg  SRC_EXAMPLES OUTDIR SEED N_TRUNC
    fault_matrix_gen.py ktp  GOOD.ktp OUTDIR SEED N_TRUNC N_FLIP N_BITS N_ZERO
    fault_matrix_gen.py st   GOOD.safetensors OUTDIR PREFIX
    fault_matrix_gen.py tok  OUTDIR

Writes the case files into OUTDIR and prints one manifest line per case on stdout:
    NAME <TAB> EXPECT <TAB> WHERE
EXPECT is "refuse" (exit 0 is a silent acceptance) or "any" (the mutated input may still be
valid: only crashes, hangs and unclear messages count). WHERE is what the refusal's message
must name: "pos" (FILE:LINE:COL of the case file), "file" (the case file's name) or a fixed
extended regular expression. Everything is derived from SEED (random.Random), so a run
rebuilds the same matrix.
"""
import json
import os
import random
import struct
import sys
import zlib


def out(name, expect, where):
    print(f"{name}\t{expect}\t{where}")


def write(d, name, data):
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- .ktg ------------------------------------------------------------------------------------
def ktg_cut_must_refuse(text, cut):
    """A prefix of a valid model is certainly invalid when it ends inside brackets, or in
    the middle of a name (outside a comment); anything else (a whole statement list, a cut in
    a comment or a number) may still be a valid model (a model needs no loss)."""
    pre = text[:cut]
    line = pre.rsplit(b"\n", 1)[-1]
    if b"#" in line:
        return False
    # brackets outside comments
    depth = 0
    for ln in pre.split(b"\n"):
        code = ln.split(b"#", 1)[0]
        depth += sum(code.count(c) for c in (b"(", b"[", b"{"))
        depth -= sum(code.count(c) for c in (b")", b"]", b"}"))
    if depth > 0:
        return True
    alpha = lambda b: chr(b).isalpha() or b == ord("_")
    return 0 < cut < len(text) and alpha(text[cut - 1]) and alpha(text[cut])


def gen_ktg(src, d, seed, n_trunc):
    rng = random.Random(seed)
    names = ["lm", "mlp", "conv_stack", "moe_block"]
    texts = {}
    for n in names:
        with open(os.path.join(src, n + ".ktg"), "rb") as f:
            texts[n] = f.read()
    for n in names:
        t = texts[n]
        cuts = sorted(set([0, len(t) - 1] + [rng.randrange(1, len(t)) for _ in range(n_trunc)]))
        for c in cuts:
            nm = f"trunc_{n}_{c}.ktg"
            write(d, nm, t[:c])
            out(nm, "refuse" if ktg_cut_must_refuse(t, c) else "any",
                "pos" if ktg_cut_must_refuse(t, c) else "file")
    lm = texts["lm"]
    # byte flips anywhere (a flip in a comment, or a digit for a digit, may stay valid)
    for i in range(8):
        p = rng.randrange(len(lm))
        b = rng.choice([0x00, 0x01, 0x7F, 0xFF, 0xC3, ord("("), ord("}"), ord("@"), ord("9")])
        nm = f"flip_lm_{p}_{b:02x}.ktg"
        write(d, nm, lm[:p] + bytes([b]) + lm[p + 1:])
        out(nm, "any", "file")
    code_at = lm.index(b"param embed.w")  # a position in code, not in a comment
    mlp = texts["mlp"]
    w1 = mlp.index(b"param w1")
    special = {
        # must refuse, at a position
        "bom.ktg": (b"\xef\xbb\xbf" + mlp, "any", "file"),
        "nonutf8_ident.ktg": (mlp[:w1] + b"param w\xff1" + mlp[w1 + 8:], "refuse", "pos"),
        "nonutf8_comment.ktg": (b"# caf\xe9 \xff\xfe\n" + mlp, "any", "file"),
        "overlong_utf8.ktg": (mlp[:w1] + b"param w\xc0\xaf" + mlp[w1 + 8:], "refuse", "pos"),
        "ctrl_in_code.ktg": (lm[:code_at] + b"\x01\x1b[31m" + lm[code_at:], "refuse", "pos"),
        "nul_in_code.ktg": (lm[:code_at] + b"\x00" + lm[code_at:], "refuse", "pos"),
        "huge_const.ktg": (mlp.replace(b"const N = 32", b"const N = 99999999999999999999999999"),
                           "refuse", "pos"),
        "huge_dim.ktg": (mlp.replace(b"const N = 32", b"const N = 4611686018427387904"),
                         "refuse", "file"),
        "huge_product.ktg": (mlp.replace(b"const D = 16", b"const D = 3037000500"), "refuse",
                             "file"),
        "div_zero.ktg": (mlp.replace(b"const H = 4 * D", b"const H = 4 / 0"), "refuse", "pos"),
        "neg_dim.ktg": (mlp.replace(b"f32[N, D]", b"f32[-4, D]"), "refuse", "pos"),
        "zero_dim.ktg": (mlp.replace(b"f32[N, D]", b"f32[0, D]"), "refuse", "pos"),
        "deep_parens_100.ktg": (mlp.replace(b"h = silu(h)", b"h = silu(" + b"(" * 100 + b"h" +
                                            b")" * 100 + b")"), "refuse", "pos"),
        "deep_parens_100k.ktg": (b"x = " + b"(" * 100000 + b"\n", "refuse", "pos"),
        "deep_brackets.ktg": (b"input x: f32" + b"[" * 5000 + b"\n", "refuse", "pos"),
        "deep_blocks.ktg": (b"input x: f32[4]\n" + b"repeat i in 0..1 {\n" * 40 +
                            b"}\n" * 40 + b"output x\n", "refuse", "pos"),
        "deep_interp.ktg": (b"input x: f32[4]\ny" + b"{" * 200 + b"1" + b"}" * 200 +
                            b" = silu(x)\n", "refuse", "pos"),
        "long_ident_param.ktg": (mlp.replace(b"param b2", b"param b" + b"q" * 1500), "any",
                                 "file"),
        "long_ident_op.ktg": (mlp.replace(b"h = silu(h)", b"h = " + b"z" * 100000 + b"(h)"),
                              "refuse", "pos"),
        "long_line_comment.ktg": (b"#" + b"c" * 1000000 + b"\n" + mlp, "any", "file"),
        "unknown_op.ktg": (mlp.replace(b"h = silu(h)", b"h = frobnicate(h)"), "refuse", "pos"),
        "unknown_attr.ktg": (mlp.replace(b"ignore_index = -100", b"bogus = 1"), "refuse", "pos"),
        "unknown_stmt.ktg": (mlp + b"frob x\n", "refuse", "pos"),
        "bad_type.ktg": (mlp.replace(b"input y: i32[N]", b"input y: q99[N]"), "refuse", "pos"),
        "moe_layer_1e9.ktg": (lm.replace(b"layer = l", b"layer = 1000000000"), "refuse", "file"),
        "moe_layer_neg.ktg": (lm.replace(b"layer = l", b"layer = -1"), "refuse", "pos"),
        "moe_layer_huge.ktg": (lm.replace(b"layer = l", b"layer = 99999999999999999999"),
                               "refuse", "pos"),
        "topk_huge.ktg": (lm.replace(b"const TOPK = 2", b"const TOPK = 1000000"), "refuse",
                          "file"),
        "repeat_1e8.ktg": (b"input x: f32[4]\nrepeat i in 0..100000000 {\n x = silu(x)\n}\n"
                           b"output x\n", "refuse", "pos"),
        "many_errors.ktg": (b"@@@\n" * 500, "refuse", "pos"),
        "unterminated_block.ktg": (b"input x: f32[4]\nrepeat i in 0..2 {\n x = silu(x)\n",
                                   "refuse", "pos"),
        "dup_param.ktg": (mlp.replace(b"param b2", b"param w1"), "refuse", "pos"),
        "crlf.ktg": (mlp.replace(b"\n", b"\r\n"), "any", "file"),
        "lone_cr.ktg": (mlp.replace(b"\n", b"\r"), "any", "file"),
        "empty.ktg": (b"", "any", "file"),
        "only_nul.ktg": (b"\x00" * 64, "refuse", "pos"),
        "binary_junk.ktg": (bytes(rng.randrange(256) for _ in range(4096)), "refuse", "file"),
        "float_overflow.ktg": (mlp.replace(b"normal(0.02)", b"normal(1e999999)", 1), "refuse",
                               "pos"),
    }
    for nm, (data, expect, where) in special.items():
        write(d, nm, data)
        out(nm, expect, where)


# ---- .ktp ------------------------------------------------------------------------------------
def gen_ktp(good_path, d, seed, n_trunc, n_flip, n_bits, n_zero):
    rng = random.Random(seed)
    with open(good_path, "rb") as f:
        good = f.read()
    L = len(good)

    def emit(nm, data, expect=None):
        if expect is None:
            expect = "any" if data == good else "refuse"
        write(d, nm, data)
        out(nm, expect, "file")

    offs = sorted(set([0, 1, 7, 8, 12, 16, 23, 24, 25, 28, L - 4, L - 1] +
                      [rng.randrange(L) for _ in range(max(0, n_trunc - 12))]))
    for c in offs:
        emit(f"trunc_{c}.ktp", good[:c])
    for i in range(n_flip):
        p = rng.randrange(L)
        v = rng.randrange(1, 256)
        b = bytearray(good)
        b[p] ^= v
        emit(f"flip_{i}_{p}.ktp", bytes(b))
    for i in range(n_bits):
        b = bytearray(good)
        for _ in range(rng.choice([1, 1, 2, 3])):
            p = rng.randrange(L)
            b[p] ^= 1 << rng.randrange(8)
        emit(f"bits_{i}.ktp", bytes(b))
    for i in range(n_zero):
        p = rng.randrange(L)
        n = rng.choice([1, 4, 8, 16, 64, 256])
        b = bytearray(good)
        b[p:p + n] = bytes(len(b[p:p + n]))
        emit(f"zero_{i}_{p}_{n}.ktp", bytes(b))
    emit("append_1.ktp", good + b"\x00")
    emit("append_4k.ktp", good + bytes(4096))
    emit("doubled.ktp", good + good)

    # re-checksummed field mutations: the CRC no longer catches them, the validator must; a
    # program that still validates may load (expect "any")
    body = good[24:L - 4]

    def rebuild(magic=b"KTPROGRM", version=None, flags=0, size=None, body_=body):
        ver = struct.unpack_from("<I", good, 8)[0] if version is None else version
        sz = len(body_) if size is None else size
        img = magic + struct.pack("<IIQ", ver, flags, sz) + body_
        return img + struct.pack("<I", zlib.crc32(img) & 0xFFFFFFFF)

    emit("crc_version_0.ktp", rebuild(version=0), "refuse")
    emit("crc_version_1.ktp", rebuild(version=1), "refuse")
    emit("crc_version_99.ktp", rebuild(version=99), "refuse")
    emit("crc_version_max.ktp", rebuild(version=0xFFFFFFFF), "refuse")
    emit("crc_flags_1.ktp", rebuild(flags=1), "any")
    emit("crc_size_plus.ktp", rebuild(size=len(body) + 1), "refuse")
    emit("crc_size_minus.ktp", rebuild(size=len(body) - 1), "refuse")
    emit("crc_size_huge.ktp", rebuild(size=(1 << 63) + 5), "refuse")
    emit("crc_body_short.ktp", rebuild(body_=body[:len(body) // 2]), "refuse")
    emit("crc_body_empty.ktp", rebuild(body_=b""), "refuse")
    for i in range(max(0, 345 - n_trunc - n_flip - n_bits - n_zero - 13 - 10) if n_trunc > 40
                   else 8):
        b = bytearray(body)
        for _ in range(rng.choice([1, 1, 2, 4])):
            p = rng.randrange(len(b))
            b[p] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
        emit(f"crc_body_{i}.ktp", rebuild(body_=bytes(b)), "any")


# ---- safetensors -----------------------------------------------------------------------------
def st_parse(data):
    n = struct.unpack_from("<Q", data, 0)[0]
    hdr = json.loads(data[8:8 + n])
    return hdr, data[8 + n:]


def st_build(hdr_bytes, payload):
    return struct.pack("<Q", len(hdr_bytes)) + hdr_bytes + payload


def gen_st(good_path, d, prefix):
    with open(good_path, "rb") as f:
        good = f.read()
    hdr, payload = st_parse(good)
    names = [k for k in hdr if k != "__metadata__"]
    first = max(names, key=lambda k: hdr[k]["data_offsets"][1] - hdr[k]["data_offsets"][0])
    n_hdr = struct.unpack_from("<Q", good, 0)[0]

    def j(h):
        return json.dumps(h, separators=(",", ":")).encode()

    def mod(fn):
        h = json.loads(j(hdr))
        fn(h)
        return st_build(j(h), payload)

    def setf(key, val):
        def f(h):
            h[first][key] = val
        return f

    def rename(new):
        def f(h):
            h[new] = h.pop(first)
        return f

    def overlap(h):
        others = [k for k in names if k != first]
        h[others[0]]["data_offsets"] = list(h[first]["data_offsets"])
        h[others[0]]["shape"] = list(h[first]["shape"])
        h[others[0]]["dtype"] = h[first]["dtype"]

    def hole(h):
        # the last tensor's range moved up, leaving a gap (and past the end)
        last = max(names, key=lambda k: hdr[k]["data_offsets"][1])
        a, b = h[last]["data_offsets"]
        h[last]["data_offsets"] = [a + 4, b + 4]

    a, b = hdr[first]["data_offsets"]
    dup = j(hdr)[:-1] + b"," + json.dumps(first).encode() + b":" + json.dumps(hdr[first]).encode() + b"}"
    cases = {
        "empty": b"",
        "trunc_4": good[:4],
        "trunc_header": good[:8 + n_hdr // 2],
        "trunc_data": good[:len(good) - 3],
        "trailing": good + b"\x00" * 8,
        "hdrlen_huge": struct.pack("<Q", (1 << 63) | 7) + good[8:],
        "hdrlen_past_end": struct.pack("<Q", len(good)) + good[8:],
        "hdrlen_zero": struct.pack("<Q", 0) + good[8:],
        "not_json": st_build(b"this is { not json" + b" " * 40, payload),
        "json_array": st_build(b"[1,2,3]", payload),
        "dtype_unknown": mod(setf("dtype", "F99")),
        "dtype_i32": mod(setf("dtype", "I32")),
        "dtype_number": mod(setf("dtype", 7)),
        "shape_mismatch": mod(setf("shape", [3])),
        "shape_negative": mod(setf("shape", [-1, 4])),
        "shape_overflow": mod(setf("shape", [1 << 62, 1 << 62])),
        "offsets_past_end": mod(setf("data_offsets", [a, b + 1000000])),
        "offsets_reversed": mod(setf("data_offsets", [b, a])),
        "offsets_string": mod(setf("data_offsets", ["0", "4"])),
        "overlap": mod(overlap),
        "hole": mod(hole),
        "duplicate_name": st_build(dup, payload),
        "name_1000": mod(rename("n" * 1000)),
        "name_nonutf8": st_build(j(hdr).replace(json.dumps(first).encode(),
                                                b'"' + first.encode()[:2] + b'\xff\xfe"', 1),
                                 payload),
        "name_control": mod(rename(first + "\u0001\u001b[2J")),
        "metadata_not_str": mod(lambda h: h.__setitem__("__metadata__", {"k": 5})),
        "header_nul": st_build(j(hdr) + b"\x00" * 8, payload),
    }
    for nm, data in cases.items():
        fn = f"{prefix}_{nm}.safetensors"
        write(d, fn, data)
        out(fn, "refuse", "file")


# ---- token files -----------------------------------------------------------------------------
def gen_tok(d):
    """VOCAB 64, u16 unless said (the manifest's third column there carries extra kt-train
    arguments after a '|': WHERE|ARGS)."""
    rng = random.Random(7)
    ok = b"".join(struct.pack("<H", rng.randrange(64)) for _ in range(512))
    cases = [
        ("empty.bin", b"", "file", ""),
        ("odd.bin", ok + b"\x01", "file", ""),
        ("one_byte.bin", b"\x01", "file", ""),
        ("oov_first.bin", struct.pack("<H", 64) + ok, "file", ""),
        ("oov_last.bin", ok + struct.pack("<H", 65535), "file", ""),
        ("i32_negative.bin", b"".join(struct.pack("<i", v) for v in [1, 2, -5, 3] * 64),
         "file", "--data-format i32"),
        ("i32_odd.bin", struct.pack("<i", 1) * 50 + b"\x00\x00", "file", "--data-format i32"),
        ("u8_oov.bin", bytes(range(256)) * 4, "file", "--data-format u8"),
        ("header_past.bin", ok, "file", "--data-header 4096"),
        ("header_all.bin", ok, "file", f"--data-header {len(ok)}"),
        ("bad_format.bin", ok, "--data-format", "--data-format u17"),
    ]
    for nm, data, where, args in cases:
        write(d, nm, data)
        out(nm, "refuse", where + "|" + args)


def main():
    kind = sys.argv[1]
    if kind == "ktg":
        gen_ktg(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif kind == "ktp":
        gen_ktp(sys.argv[2], sys.argv[3], int(sys.argv[4]), *map(int, sys.argv[5:9]))
    elif kind == "st":
        gen_st(sys.argv[2], sys.argv[3], sys.argv[4])
    elif kind == "tok":
        gen_tok(sys.argv[2])


if __name__ == "__main__":
    main()
