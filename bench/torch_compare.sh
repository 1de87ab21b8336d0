#!/usr/bin/env bash
# dc-run against PyTorch eager (bench/torch_peer.py) on the same model and shapes, one thread per
# process, runs alternated (dc, PyTorch, dc, PyTorch, ...) so the machine's noise falls on both.
#   bench/torch_compare.sh [build-dir] [pairs] [config ...]
# configs: tiny-1 small-1 wide-1 (one core each, both pinned to cpu 0 with taskset) and small-2
# wide-2 (dc-run --nproc 2 against PyTorch DDP on 2 gloo ranks); default all five. `wide` is
# --layers 4 --hidden 512 --heads 8 --kv-heads 4 --ffn 1376 --vocab 4096 --seq 256 --micro-batch 2.
# Prints each pair's tokens/s, then per config both medians, their ratio (dc / PyTorch) and the
# load average before and after. Python: $PYTHON, default /usr/bin/python3 (needs torch).
# dc's plans: one rank's from `dc-plan --synthetic --hardware cpu`; two or more ranks' from a
# trace of this machine (dc-collect, 3 steps, then dc-plan on it with DC_ROUNDS profile-guided
# rounds of 5 steps, default 2: dc's own workflow, where the plan sees the Gloo costs it will meet,
# and a plan the simulator misjudged is measured against the one re-planned from its run; the
# rounds' lines are printed; DC_ROUNDS=0 keeps the first plan). DC_PLAN=synthetic plans every
# config synthetically.
set -euo pipefail
build=${1:-build}
pairs=${2:-5}
shift $(($# < 2 ? $# : 2))
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(tiny-1 small-1 wide-1 small-2 wide-2)
python=${PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
bin="$build/tools"
work=$(mktemp -d /tmp/dc-torch-compare-XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# dc-run's own flag for BLAS threads, where this build has it (older builds use 1 thread).
dc_threads=()
if "$bin/dc-run" --help | grep -q -- --threads-per-rank; then dc_threads=(--threads-per-rank 1); fi

# shellcheck source=bench/cpu_models.sh
. "$(dirname "$0")/cpu_models.sh"

field() { "$python" -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"; }

echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(getconf _NPROCESSORS_ONLN) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "torch: $("$python" -c 'import torch; print(torch.__version__)')  dc: $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)  pairs: $pairs  OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)}"
summary=()
for config in "${configs[@]}"; do
  model=${config%-*}
  world=${config##*-}
  # shellcheck disable=SC2207  # the flags are words
  flags=($(model_flags "$model"))
  steps=$(steps_for "$model")
  warmup=2
  pin=()
  ddp=()
  if [ "$world" = 1 ]; then pin=(taskset -c 0); else ddp=(--ddp "$world"); fi
  if [ "$world" = 1 ] || [ "${DC_PLAN:-trace}" = synthetic ]; then
    "$bin/dc-plan" --synthetic --hardware cpu "${flags[@]}" --world "$world" -o "$work/$config.dcplan" >/dev/null
    echo "$config: plan from dc-plan --synthetic --hardware cpu"
  else
    "$bin/dc-collect" "${flags[@]}" --nproc "$world" --steps 3 --warmup 1 "${dc_threads[@]}" \
      -o "$work/$config.db" --quiet >/dev/null
    "$bin/dc-plan" "$work/$config.db" --no-cache --rounds "${DC_ROUNDS:-2}" --round-steps 5 \
      -o "$work/$config.dcplan" | { grep -E '^(round|kept)' || true; } | sed "s/^/$config: /"
    echo "$config: plan from a dc-collect trace of this machine ($world ranks, 3 steps), ${DC_ROUNDS:-2} profile-guided round(s)"
  fi
  load_before=$(cut -d' ' -f1-3 /proc/loadavg)
  dc_runs=()
  torch_runs=()
  for ((i = 1; i <= pairs; i++)); do
    dc=$("${pin[@]}" "$bin/dc-run" "$work/$config.dcplan" --steps "$steps" --warmup "$warmup" "${dc_threads[@]}" --json --quiet | field tokens_per_second)
    torch=$("${pin[@]}" "$python" "$here/torch_peer.py" "${flags[@]}" --steps "$steps" --warmup "$warmup" --threads 1 "${ddp[@]}" | field tokens_per_second)
    dc_runs+=("$dc")
    torch_runs+=("$torch")
    printf "%-8s pair %d: dc %10.1f tokens/s  pytorch %10.1f tokens/s\n" "$config" "$i" "$dc" "$torch"
  done
  load_after=$(cut -d' ' -f1-3 /proc/loadavg)
  summary+=("$("$python" - "$config" "${dc_runs[*]}" "${torch_runs[*]}" "$load_before" "$load_after" <<'PY'
import statistics, sys
config, dc, torch, before, after = sys.argv[1:]
dc = statistics.median(map(float, dc.split()))
torch = statistics.median(map(float, torch.split()))
print(f"| {config} | {dc:.1f} | {torch:.1f} | {dc / torch:.2f}x | {before} -> {after} |")
PY
)")
done
echo
echo "| config | dc tokens/s (median) | PyTorch tokens/s (median) | dc / PyTorch | load average |"
echo "|---|---|---|---|---|"
printf "%s\n" "${summary[@]}"
