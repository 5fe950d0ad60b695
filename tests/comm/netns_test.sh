#!/usr/bin/env bash
# Two "hosts": 2 ranks in two network namespaces joined by a veth pair (addresses only inside
# the namespaces this script creates), UCX over TCP on the veth (a namespace alone does not
# separate hosts for UCX's shared memory, research note section 6). Runs the collectives and
# the agree scenario. Exits 77 (skipped) when not root or without iproute2.
# With kt-train's tools also given: three "hosts" (namespaces, each with its own kt0 on a
# bridge that lives in a fourth namespace) train examples/lm.ktg through kt-launch --hosts
# ("ip netns exec {host}"), UCX over TCP; the losses and the saved parameters equal the
# one-rank run (train_check: losses 1e-5 relative, parameters 1e-5 of each tensor's largest
# magnitude); and an injected failure on host 2 reaches all three as the root cause.
# KT_TRAIN_FLAGS: further kt-train flags for both runs (the parallel modes).
# usage: netns_test.sh COMM_RANK_TEST [KT_GRAPHC KT_TRAIN KT_LAUNCH TRAIN_CHECK [FLAGS...]]
set -uo pipefail
rank_test=$1
graphc=${2:-} train=${3:-} launch=${4:-} check=${5:-}
shift $(($# < 5 ? $# : 5))
flags=("$@")
if [ "$(id -u)" -ne 0 ] || ! command -v ip > /dev/null; then
  echo "skipped: needs root and iproute2 (ip netns)"
  exit 77
fi
a=ktcA$$ b=ktcB$$ br=ktcS$$
hosts=(ktcH1$$ ktcH2$$ ktcH3$$)
cleanup() {
  for n in "$a" "$b" "$br" "${hosts[@]}"; do ip netns del "$n" 2> /dev/null; done
  rm -rf "${work:-/nonexistent}"
}
trap cleanup EXIT
if ! { ip netns add "$a" && ip netns add "$b" &&
       ip link add "v$a" type veth peer name "v$b" &&
       ip link set "v$a" netns "$a" && ip link set "v$b" netns "$b" &&
       ip -n "$a" addr add 10.199.0.1/24 dev "v$a" && ip -n "$b" addr add 10.199.0.2/24 dev "v$b" &&
       ip -n "$a" link set lo up && ip -n "$b" link set lo up &&
       ip -n "$a" link set "v$a" up && ip -n "$b" link set "v$b" up; }; then
  echo "skipped: could not create the namespaces"
  exit 77
fi
failures=0
src_dir=$(cd "$(dirname "$0")/../.." && pwd)
for sc in collectives agree; do
  common=(KT_WORLD_SIZE=2 KT_MASTER_ADDR=10.199.0.1 KT_MASTER_PORT=29611 KT_COMM_TIMEOUT_MS=10000
          KT_COMM_TRANSPORT=tcp)
  timeout 60 ip netns exec "$a" env "${common[@]}" KT_RANK=0 UCX_NET_DEVICES="v$a" \
    "$rank_test" "$sc" > "/tmp/$a.0.log" 2>&1 &
  p0=$!
  timeout 60 ip netns exec "$b" env "${common[@]}" KT_RANK=1 UCX_NET_DEVICES="v$b" \
    "$rank_test" "$sc" > "/tmp/$a.1.log" 2>&1
  r1=$?
  wait "$p0"
  r0=$?
  if [ "$r0" -ne 0 ] || [ "$r1" -ne 0 ]; then
    echo "FAIL: $sc across namespaces (exit $r0 / $r1)"
    cat "/tmp/$a.0.log" "/tmp/$a.1.log"
    failures=$((failures + 1))
  else
    echo "ok: $sc across namespaces: $(tail -n 1 "/tmp/$a.0.log")"
  fi
  rm -f "/tmp/$a.0.log" "/tmp/$a.1.log"
done

# ---- three hosts on a bridge: kt-train ----------------------------------------------------------
if [ -z "$check" ]; then
  [ "$failures" -eq 0 ]; exit
fi
if ! { ip netns add "$br" && ip -n "$br" link add kts type bridge && ip -n "$br" link set kts up; }; then
  echo "skipped: could not create the bridge"; exit 77
fi
for i in 0 1 2; do
  h=${hosts[$i]}
  if ! { ip netns add "$h" && ip -n "$h" link add kt0 type veth peer name "p$i" netns "$br" &&
         ip -n "$br" link set "p$i" master kts && ip -n "$br" link set "p$i" up &&
         ip -n "$h" addr add "10.199.1.$((i + 1))/24" dev kt0 && ip -n "$h" link set kt0 up &&
         ip -n "$h" link set lo up; }; then
    echo "skipped: could not create host $h on the bridge"; exit 77
  fi
done
work=$(mktemp -d)
cd "$work" || exit 1
sizes=(-D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
"$graphc" "$src_dir/examples/lm.ktg" -o lm1.ktp -D T=48 "${sizes[@]}" > /dev/null &&
"$graphc" "$src_dir/examples/lm.ktg" -o lm3.ktp -D T=16 "${sizes[@]}" > /dev/null &&
"$check" tokens tok.bin 4096 64 markov > /dev/null || { echo "FAIL: the model or the tokens"; exit 1; }
common=(--data tok.bin --steps 5 --threads 1 --log-every 5 --optimizer sgd --lr 0.5 "${flags[@]}")
"$train" lm1.ktp "${common[@]}" --losses ref.txt --save ref.safetensors > ref.log 2>&1 ||
  { echo "FAIL: the one-rank run"; cat ref.log; exit 1; }
across=("$launch" -n 3 --hosts "$(IFS=,; echo "${hosts[*]}")" --host-cmd "ip netns exec {host}"
        --master-addr 10.199.1.1 --transport tcp --timeout-ms 20000 --)
if UCX_NET_DEVICES=kt0 timeout 120 "${across[@]}" "$train" lm3.ktp "${common[@]}" \
     --losses hosts.txt --save hosts.safetensors > hosts.log 2>&1 &&
   l=$("$check" losses hosts.txt ref.txt 1e-5) && p=$("$check" params hosts.safetensors ref.safetensors 1e-5); then
  echo "ok: 3 hosts on a bridge (kt-launch --hosts, tcp) train as one rank: $l; $p"
else
  echo "FAIL: 3 hosts on a bridge: ${l:-} ${p:-}"; tail -20 hosts.log; failures=$((failures + 1))
fi
UCX_NET_DEVICES=kt0 KT_FAULT="rank=1,step=2,op=cross_entropy" timeout 120 "${across[@]}" \
  "$train" lm3.ktp "${common[@]}" > fault.log 2>&1
roots=$(sed -n 's/^\[rank \([0-9]\)\] kt-train: rank \1 stops: //p' fault.log | sort -u)
if [ "$(grep -c 'kt-train: rank [0-2] stops: rank 1: step 2: cross_entropy' fault.log)" -eq 3 ] &&
   [ "$(wc -l <<< "$roots")" -eq 1 ]; then
  echo "ok: a failure on host 2 reaches the 3 hosts as: $roots"
else
  echo "FAIL: an injected failure across hosts"; tail -20 fault.log; failures=$((failures + 1))
fi
[ "$failures" -eq 0 ]
