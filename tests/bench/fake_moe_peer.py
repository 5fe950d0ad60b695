"""A stand-in for tools/kt-bench/moe_torch_peer.py, without torch, for
test_kt_bench.sh: it speaks the same protocol and answers each call with a fixed time.

usage: fake_moe_peer.py INPUTS ... (the real peer's arguments, ignored but INPUTS, which must
exist), with FAKE_PEER_FWD_MS and FAKE_PEER_FWDBWD_MS (the times it answers, default 4 and 6),
FAKE_PEER_FAIL_AFTER (exit after answering that many calls; default never) and
FAKE_PEER_HANG_AFTER (answer no more after that many calls, and wait). It checks
that each pass asks for calls 0, 1, 2, ... in order (the ids of libkt's calls), and exits 4
when not."""
import json
import os
import sys
import time

if not os.path.exists(sys.argv[1]):
    print("inputs %s not found" % sys.argv[1], flush=True)
    sys.exit(1)
ms = {"fwd": float(os.environ.get("FAKE_PEER_FWD_MS", "4")),
      "fwdbwd": float(os.environ.get("FAKE_PEER_FWDBWD_MS", "6"))}
fail_after = int(os.environ.get("FAKE_PEER_FAIL_AFTER", "-1"))
hang_after = int(os.environ.get("FAKE_PEER_HANG_AFTER", "-1"))
print("a line that is not JSON, as Python's warnings are", flush=True)
print(json.dumps({"ready": True, "fake": True}), flush=True)
calls, expect = 0, {"fwd": 0, "fwdbwd": 0}
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
        break
    kind, call = words[0], int(words[1])
    if kind not in ms or call != expect[kind] or (kind == "fwdbwd" and expect["fwd"] == 0):
        print("fake peer: unexpected request %r" % line.strip(), flush=True)
        sys.exit(4)
    if calls == hang_after:
        time.sleep(3600)
    if calls == fail_after:
        print("fake peer: failing as asked", flush=True)
        sys.exit(3)
    calls += 1
    expect[kind] += 1
    print(json.dumps({"ms": ms[kind]}), flush=True)
