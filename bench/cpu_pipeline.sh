#!/usr/bin/env bash
# The cpu pipeline measured end to end: for a model, record a trace, plan it with each policy,
# run each plan and report predicted against measured step time, tokens/s and peak bytes.
#   bench/cpu_pipeline.sh [build-dir] [model] [nproc] [gas] [steps] [collect flags]
# e.g. bench/cpu_pipeline.sh build tiny 2 4 10 "--recompute" (the flags go to dc-collect).
# Medians over `steps` measured steps after one warm-up; the machine is shared and noisy, so
# compare the ratios within one run.
set -euo pipefail
build=${1:-build}
model=${2:-tiny}
nproc=${3:-2}
gas=${4:-4}
steps=${5:-10}
collect_flags=${6:-}
bin="$build/tools"
work=$(mktemp -d /tmp/dc-bench-XXXXXX)
trap 'rm -rf "$work"' EXIT

# shellcheck disable=SC2086  # the flags are words
"$bin/dc-collect" --model "$model" --nproc "$nproc" --gas "$gas" --steps 3 --warmup 1 $collect_flags -o "$work/trace.db" --quiet >/dev/null
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(uname -m)  model: $model ${collect_flags}  ranks: $nproc  gas: $gas  steps: $steps"
printf "%-12s %10s %10s %10s %12s %12s %12s %8s\n" policy predicted measured ratio tokens/s peak_bytes pred_peak instrs
for policy in baseline zero3-offload deepcompile dc; do
  if ! "$bin/dc-plan" "$work/trace.db" --policy "$policy" --no-cache -o "$work/$policy.dcplan" --json >"$work/$policy.plan.json" 2>"$work/$policy.err"; then
    printf "%-12s %s\n" "$policy" "$(cat "$work/$policy.err")"
    continue
  fi
  "$bin/dc-run" "$work/$policy.dcplan" --steps "$steps" --warmup 1 --json >"$work/$policy.run.json"
  python3 - "$policy" "$work/$policy.plan.json" "$work/$policy.run.json" <<'PY'
import json, sys
policy, plan, run = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
p, m = plan["predicted"]["step_seconds"], run["step_seconds_median"]
print(f"{policy:<12} {p:10.5f} {m:10.5f} {m / p:10.3f} {run['tokens_per_second']:12.0f} "
      f"{run['peak_device_bytes']:12d} {plan['predicted']['peak_device_bytes']:12d} {plan['instructions']:8d}")
PY
done
