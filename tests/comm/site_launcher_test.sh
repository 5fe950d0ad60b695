#!/usr/bin/env bash
# The master address under a site launcher (comm_ucx/master_addr.c), with its variables set
# by hand (no Slurm or Open MPI here): Slurm's first host of SLURM_STEP_NODELIST is used (2
# ranks train their collectives through "localhost,ktnode[2-3]"; "ktnode[07-09]" is named
# when it does not resolve); without a node list, or under mpirun on several hosts without
# KT_MASTER_ADDR, the error says what to set instead of waiting at 127.0.0.1; mpirun with
# every rank on this host needs nothing.
# The ranks are kt-train's (2 ranks of examples/lm.ktg, one step): it reads the same variables.
# usage: site_launcher_test.sh KT_GRAPHC KT_TRAIN TRAIN_CHECK
set -uo pipefail
graphc=$1 train=$2 check=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
failures=0
port=$((20000 + $$ % 20000))
base=(env -u KT_MASTER_ADDR -u MASTER_ADDR -u KT_RANK -u KT_WORLD_SIZE -u RANK -u WORLD_SIZE
      KT_COMM_TIMEOUT_MS=5000 KT_MASTER_PORT=$port)
two() { # VARS-OF-RANK-0 -- VARS-OF-RANK-1: both ranks' collectives pass
  local a=() b=()
  while [ "$1" != -- ]; do a+=("$1"); shift; done; shift; b=("$@")
  port=$((port + 1))
  timeout 30 "${base[@]}" KT_MASTER_PORT=$port "${a[@]}" "${rank_cmd[@]}" > r0.log 2>&1 &
  local p=$!
  timeout 30 "${base[@]}" KT_MASTER_PORT=$port "${b[@]}" "${rank_cmd[@]}" > r1.log 2>&1
  local r1=$?; wait $p; local r0=$?
  [ $r0 -eq 0 ] && [ $r1 -eq 0 ]
}
refused() { # WHAT REGEX VARS...: rank 1 alone is refused at once, the message matches
  local what=$1 re=$2; shift 2
  local out; out=$(timeout 30 "${base[@]}" "$@" "${rank_cmd[@]}" 2>&1)
  if [ $? -eq 0 ] || ! grep -q -E -- "$re" <<< "$out"; then
    echo "FAIL: $what: $out"; failures=$((failures + 1))
  else
    echo "ok: $what: $(tail -n 1 <<< "$out" | tail -c 220)"
  fi
}
dir=$(mktemp -d); cd "$dir" || exit 1
"$graphc" "$src/examples/lm.ktg" -o lm2.ktp -D T=24 -D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 \
  -D TOPK=2 > /dev/null && "$check" tokens tok.bin 4096 64 markov > /dev/null ||
  { echo "FAIL: the model or the tokens"; exit 1; }
rank_cmd=("$train" lm2.ktp --data tok.bin --steps 1 --threads 1)
s=(SLURM_NTASKS=2 SLURM_STEP_NODELIST="localhost,ktnode[2-3]")
if two SLURM_PROCID=0 "${s[@]}" -- SLURM_PROCID=1 "${s[@]}"; then
  echo "ok: Slurm: 2 ranks meet at the first host of SLURM_STEP_NODELIST (localhost)"
else
  echo "FAIL: Slurm ranks with SLURM_STEP_NODELIST=localhost,..."; cat r0.log r1.log
  failures=$((failures + 1))
fi
o=(OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_SIZE=2)
if two OMPI_COMM_WORLD_RANK=0 "${o[@]}" -- OMPI_COMM_WORLD_RANK=1 "${o[@]}"; then
  echo "ok: mpirun: 2 ranks on this host need no address"
else
  echo "FAIL: mpirun ranks on one host"; cat r0.log r1.log; failures=$((failures + 1))
fi
refused "Slurm: the first host is named" "ktnode07" SLURM_PROCID=1 SLURM_NTASKS=2 \
  SLURM_STEP_NODELIST="ktnode[07-09],gpu1"
refused "Slurm without a node list" "SLURM_STEP_NODELIST.*KT_MASTER_ADDR" SLURM_PROCID=1 \
  SLURM_NTASKS=2 SLURM_NNODES=2
refused "mpirun on several hosts without KT_MASTER_ADDR" "KT_MASTER_ADDR" \
  OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_SIZE=2
cd / && rm -rf "$dir"
[ $failures -eq 0 ]
