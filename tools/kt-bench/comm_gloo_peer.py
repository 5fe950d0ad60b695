#!/usr/bin/env python3
"""torch.distributed (gloo) on 127.0.0.1: the peer kt-bench comm and kt-bench halo compare with.

Starts its own ranks (processes of this script) and prints one JSON object per measured
configuration on stdout (rank 0 only):

  comm: one-way latency by send/recv ping-pong (half the round trip, median over single
        round trips after warm-up) for --lat-sizes, and unidirectional bandwidth for
        --bw-sizes (rank 0 sends a window of messages, rank 1 answers with one byte; median
        over windows), sizes in bytes of uint8 tensors.
        {"op": "latency", "bytes": 8, "latency_us": 41.2}
        {"op": "bandwidth", "bytes": 1048576, "bandwidth_mbs": 2311.0}
  halo: the context-parallel halo exchange forward as NVlabs/Sana's cp_halo_exchange does it
        (causal: `--left` frames of rank r-1 in front of the shard, zeros on rank 0): p2p
        mode with dist.batch_isend_irecv, allgather mode with dist.all_gather, then the cat.
        x is [--shard, hidden] float32 for each --hidden.
        {"op": "halo", "mode": "p2p", "hidden": 256, "frames": 3, "ranks": 2, "latency_us": 120.5}

  coll: dist.all_reduce / all_gather (and reduce_scatter, which torch 1.13's gloo lacks: an
        error object instead) on --ranks ranks, float32; bytes is the whole buffer (W blocks
        for all_gather's output and reduce_scatter's input); the median over --repeats calls,
        each after a barrier, on rank 0.
        {"op": "all_reduce", "bytes": 1048576, "ranks": 4, "seconds": 0.0012}

usage: comm_gloo_peer.py comm --lat-sizes 8,64 --bw-sizes 65536,1048576
       comm_gloo_peer.py coll --ranks 4 --ops all_reduce,all_gather --sizes 4096,1048576
       comm_gloo_peer.py halo --ranks 2 --hidden 256,2048 --left 3 --shard 16 [--modes p2p,allgather]
Exit 77 when torch is missing (the caller reports the peer as null).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # the caller prints a note and a null ratio
    print(json.dumps({"error": f"torch missing: {e}"}))
    sys.exit(77)


def ints(s):
    return [int(v) for v in s.split(",") if v]


def emit(obj):
    print(json.dumps(obj), flush=True)


def comm_bench(a, rank):
    peer = 1 - rank
    for size in ints(a.lat_sizes):
        buf = torch.zeros(size, dtype=torch.uint8)
        iters = a.lat_iters if size <= 4096 else max(a.lat_iters // 4, 200)
        times = []
        dist.barrier()
        for i in range(a.warmup + iters):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            emit({"op": "latency", "bytes": size,
                  "latency_us": statistics.median(times) / 2 * 1e6})
    ack = torch.zeros(1, dtype=torch.uint8)
    for size in ints(a.bw_sizes):
        buf = torch.zeros(size, dtype=torch.uint8)
        window = max(4, min(256, (32 << 20) // size))
        rates = []
        dist.barrier()
        for r in range(1 + a.bw_rounds):
            t0 = time.perf_counter()
            for _ in range(window):
                if rank == 0:
                    dist.send(buf, peer)
                else:
                    dist.recv(buf, peer)
            if rank == 0:
                dist.recv(ack, peer)
            else:
                dist.send(ack, peer)
            if r >= 1:
                rates.append(size * window / (time.perf_counter() - t0) / 1e6)
        if rank == 0:
            emit({"op": "bandwidth", "bytes": size, "bandwidth_mbs": statistics.median(rates)})


def coll_bench(a, rank, world):
    for op in a.ops.split(","):
        for size in ints(a.sizes):
            n = max(world, size // 4 // world * world)
            x = torch.ones(n, dtype=torch.float32)
            parts = [torch.empty(n // world, dtype=torch.float32) for _ in range(world)]
            out = torch.empty(n // world, dtype=torch.float32)

            def call():
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "all_gather":
                    dist.all_gather(parts, x[: n // world])
                else:
                    dist.reduce_scatter(out, list(x.chunk(world)))
            try:
                call()
            except RuntimeError as e:  # gloo has no reduce_scatter in torch 1.13
                if rank == 0:
                    emit({"op": op, "bytes": n * 4, "ranks": world, "error": str(e)[:120]})
                break
            call()
            reps = a.repeats * (20 if n * 4 <= 65536 else 1)
            if n * 4 >= (64 << 20):
                reps = a.repeats // 2 + 2
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                emit({"op": op, "bytes": n * 4, "ranks": world,
                      "seconds": statistics.median(times)})


def halo_forward(x, left, mode, rank, world):
    """Sana's causal halo forward: [left frames of rank-1 | x] (zeros on rank 0)."""
    t = x.shape[0]
    if mode == "p2p":
        recv = torch.zeros((left,) + tuple(x.shape[1:]), dtype=x.dtype)
        ops = []
        if rank > 0:
            ops.append(dist.P2POp(dist.irecv, recv, rank - 1))
        if rank < world - 1:
            ops.append(dist.P2POp(dist.isend, x.narrow(0, t - left, left).contiguous(), rank + 1))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return torch.cat([recv, x], dim=0)
    send = x.narrow(0, t - left, left).contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    recv = parts[rank - 1] if rank > 0 else torch.zeros_like(send)
    return torch.cat([recv, x], dim=0)


def halo_bench(a, rank, world):
    for mode in a.modes.split(","):
        for hidden in ints(a.hidden):
            x = torch.randn(a.shard, hidden)
            for _ in range(a.warmup):
                halo_forward(x, a.left, mode, rank, world)
            means = []
            for _ in range(a.batches):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.batch):
                    halo_forward(x, a.left, mode, rank, world)
                means.append((time.perf_counter() - t0) / a.batch)
            if rank == 0:
                emit({"op": "halo", "mode": mode, "hidden": hidden, "frames": a.left,
                      "shard": a.shard, "ranks": world,
                      "latency_us": statistics.median(means) * 1e6})


def rank_main(a, rank, world, port):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "KT_BENCH_NO_PIN" not in os.environ:  # one CPU per rank, as kt-bench pins its ranks
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        if a.what == "comm":
            comm_bench(a, rank)
        elif a.what == "coll":
            coll_bench(a, rank, world)
        else:
            halo_bench(a, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["comm", "halo", "coll"])
    ap.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather")
    ap.add_argument("--sizes", default="4096,1048576")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--lat-sizes", default="8,64,512,4096,65536")
    ap.add_argument("--bw-sizes", default="65536,1048576,16777216")
    ap.add_argument("--lat-iters", type=int, default=2000)
    ap.add_argument("--bw-rounds", type=int, default=7)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", default="256,512,1024,2048")
    ap.add_argument("--left", type=int, default=3)
    ap.add_argument("--shard", type=int, default=16)
    ap.add_argument("--modes", default="p2p,allgather")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    world = 2 if a.what == "comm" else a.ranks
    if a.rank >= 0:
        rank_main(a, a.rank, world, a.port)
        return 0
    # the launcher: one process per rank, this script again; rank 0's stdout is ours
    import subprocess
    port = free_port()
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + \
              ["--rank", str(r), "--port", str(port)]
        procs.append(subprocess.Popen(cmd, stdout=None if r == 0 else subprocess.DEVNULL))
    rc = 0
    try:
        for p in procs:
            rc = rc or p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
