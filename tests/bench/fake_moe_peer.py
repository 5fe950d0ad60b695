"""A stand-in for tools/kt-bench/moe_torch_peer.py --serve, without torch, for
test_kt_bench.sh: it speaks the same protocol and answers each call with a fixed time.

usage: fake_moe_peer.py INPUTS ... (the real peer's arguments, ignored but INPUTS, which must
exist), with FAKE_PEER_MS (the time it answers, default 1.0) and FAKE_PEER_FAIL_AFTER (exit
after answering that many calls; default never)."""
import json
import os
import sys

if not os.path.exists(sys.argv[1]):
    print("inputs %s not found" % sys.argv[1], flush=True)
    sys.exit(1)
ms = float(os.environ.get("FAKE_PEER_MS", "1.0"))
fail_after = int(os.environ.get("FAKE_PEER_FAIL_AFTER", "-1"))
print("a line that is not JSON, as Python's warnings are", flush=True)
print(json.dumps({"ready": True, "fake": True}), flush=True)
calls = 0
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
        break
    assert words[0] in ("fwd", "fwdbwd") and int(words[1]) >= 0, line
    if calls == fail_after:
        print("fake peer: failing as asked", flush=True)
        sys.exit(3)
    calls += 1
    print(json.dumps({"ms": ms}), flush=True)
