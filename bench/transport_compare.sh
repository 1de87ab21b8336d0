#!/usr/bin/env bash
# dc-run's two cpu transports on the same plan: Gloo over loopback TCP (DC_CPU_TRANSPORT=tcp) and
# shared memory (shm), runs alternated (tcp, shm, tcp, shm, ...) so the machine's noise falls on
# both, one BLAS thread per rank.
#   bench/transport_compare.sh [build-dir] [pairs] [config ...]
# configs: small-2 wide-2 (default), small-4, tiny-2 (torch_compare.sh's shapes; the number is the
# ranks). Each config's plan is dc's, from a dc-collect trace of this machine (3 steps). Prints
# each pair's median step seconds, then per config both medians, their ratio (tcp / shm: above 1,
# shared memory is faster), whether every run's losses were the same bits, and the load average.
set -euo pipefail
build=${1:-build}
pairs=${2:-5}
shift $(($# < 2 ? $# : 2))
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(small-2 wide-2)
bin="$build/tools"
work=$(mktemp -d /tmp/dc-transport-compare-XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# shellcheck source=bench/cpu_models.sh
. "$(dirname "$0")/cpu_models.sh"

echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(getconf _NPROCESSORS_ONLN) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "dc: $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo unknown)  pairs: $pairs  OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)}"
summary=()
for config in "${configs[@]}"; do
  model=${config%-*}
  world=${config##*-}
  # shellcheck disable=SC2207  # the flags are words
  flags=($(model_flags "$model"))
  steps=$(steps_for "$model")
  "$bin/dc-collect" "${flags[@]}" --nproc "$world" --steps 3 --warmup 1 --threads-per-rank 1 \
    -o "$work/$config.db" --quiet >/dev/null
  "$bin/dc-plan" "$work/$config.db" --no-cache -o "$work/$config.dcplan" >/dev/null
  load_before=$(cut -d' ' -f1-3 /proc/loadavg)
  runs=""
  for ((i = 1; i <= pairs; i++)); do
    for transport in tcp shm; do
      DC_CPU_TRANSPORT=$transport "$bin/dc-run" "$work/$config.dcplan" --steps "$steps" --warmup 2 \
        --threads-per-rank 1 --json --quiet | tail -1 >"$work/run.json"
      runs+="$transport $(cat "$work/run.json")"$'\n'
      python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("%-8s pair %s: %-13s %.4f s/step" % (sys.argv[2], sys.argv[3], j["transport"], j["step_seconds_median"]))' \
        "$work/run.json" "$config" "$i"
    done
  done
  load_after=$(cut -d' ' -f1-3 /proc/loadavg)
  summary+=("$(RUNS="$runs" python3 - "$config" "$load_before" "$load_after" <<'PY'
import json, os, statistics, sys
config, before, after = sys.argv[1:]
steps = {"tcp": [], "shm": []}
losses = set()
for line in os.environ["RUNS"].splitlines():
    transport, text = line.split(" ", 1)
    run = json.loads(text)
    steps[transport].append(run["step_seconds_median"])
    losses.add(tuple(run["losses"]))
tcp, shm = statistics.median(steps["tcp"]), statistics.median(steps["shm"])
same = "yes" if len(losses) == 1 else f"no ({len(losses)} different)"
print(f"| {config} | {tcp:.4f} | {shm:.4f} | {tcp / shm:.2f}x | {same} | {before} -> {after} |")
PY
)")
done
echo
echo "| config | tcp s/step (median) | shared memory s/step (median) | tcp / shm | same losses | load average |"
echo "|---|---|---|---|---|---|"
printf "%s\n" "${summary[@]}"
