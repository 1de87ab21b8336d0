#!/usr/bin/env bash
# What checkpoints cost on the cpu backend: a save's wall time per GiB of state, a resume's
# start-up per GiB (a 1-step run from a checkpoint against a 1-step fresh run), and the
# median step time with a save after every step against none.
#   bench/checkpoint_bench.sh [build-dir] [model] [nproc] [steps]
# Medians over `steps`; the machine is shared and noisy, so compare ratios within one run.
set -euo pipefail
build=${1:-build}
model=${2:-small}
nproc=${3:-2}
steps=${4:-8}
bin="$build/tools"
work=$(mktemp -d /tmp/dc-bench-ckpt-XXXXXX)
trap 'rm -rf "$work"' EXIT

"$bin/dc-plan" --synthetic --model "$model" --world "$nproc" --hardware cpu --no-cache \
  -o "$work/p.dcplan" >/dev/null
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(uname -m)  model: $model  ranks: $nproc  steps: $steps"
"$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --json >"$work/plain.json"
"$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --save "$work/ck" --save-every 1 \
  --keep 2 --json >"$work/saving.json"
now() { date +%s.%N; }
# Three fresh 1-step runs and three 1-step runs resumed from the last checkpoint (at steps + 1),
# alternating: the difference of the medians is what a resume adds to a start.
: >"$work/fresh.txt"; : >"$work/resumes.txt"
for _ in 1 2 3; do
  t0=$(now); "$bin/dc-run" "$work/p.dcplan" --steps 1 --json >/dev/null; t1=$(now)
  awk "BEGIN { print $t1 - $t0 }" >>"$work/fresh.txt"
  t0=$(now)
  "$bin/dc-run" "$work/p.dcplan" --steps $((steps + 2)) --resume "$work/ck" --json >"$work/resumed.json"
  t1=$(now)
  awk "BEGIN { print $t1 - $t0 }" >>"$work/resumes.txt"
done
python3 - "$work/plain.json" "$work/saving.json" "$work/resumed.json" "$work/fresh.txt" "$work/resumes.txt" <<'PY'
import json, statistics, sys
plain, saving, resumed = (json.load(open(p)) for p in sys.argv[1:4])
fresh = statistics.median(float(x) for x in open(sys.argv[4]))
resumes = statistics.median(float(x) for x in open(sys.argv[5]))
saves = saving["saves"]
gib = saves[-1]["bytes"] / 2**30
save_s = statistics.median(s["seconds"] for s in saves)
step = plain["step_seconds_median"]
step_saving = saving["step_seconds_median"]
resume_s = resumes - fresh
print(f"checkpoint: {saves[-1]['bytes'] / 2**20:.1f} MiB over {plain['world_size']} rank file(s), {len(saves)} saves")
print(f"save: median {save_s:.3f} s = {save_s / gib:.2f} s/GiB = {save_s / step:.2f} steps")
print(f"resume: a 1-step run from the checkpoint {resumes:.3f} s, a fresh 1-step run {fresh:.3f} s "
      f"(medians of 3): {resume_s:+.3f} s = {resume_s / gib:+.2f} s/GiB")
print(f"step median: {step:.4f} s without saving, {step_saving:.4f} s with a save after every step "
      f"(the save runs between steps, outside the step's time: {step_saving / step:.2f}x)")
wall_saving = sum(saving["step_seconds"]) + sum(s["seconds"] for s in saves)
print(f"wall of the measured steps with their saves over without: {wall_saving / sum(plain['step_seconds']):.2f}x")
PY
