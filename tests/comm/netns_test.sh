#!/usr/bin/env bash
# Two "hosts": 2 ranks in two network namespaces joined by a veth pair (addresses only inside
# the namespaces this script creates), UCX over TCP on the veth (a namespace alone does not
# separate hosts for UCX's shared memory, research note section 6). Runs the collectives and
# the agree scenario. Exits 77 (skipped) when not root or without iproute2.
# usage: netns_test.sh COMM_RANK_TEST
set -uo pipefail
rank_test=$1
if [ "$(id -u)" -ne 0 ] || ! command -v ip > /dev/null; then
  echo "skipped: needs root and iproute2 (ip netns)"
  exit 77
fi
a=ktcA$$ b=ktcB$$
cleanup() { ip netns del "$a" 2> /dev/null; ip netns del "$b" 2> /dev/null; }
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
[ "$failures" -eq 0 ]
