#!/usr/bin/env bash
# What checkpoints cost on the cpu backend, from alternated runs (the machine is shared and
# noisy, so every figure is a median and the comparisons are within one invocation):
#   - save: a save's wall seconds (every rank's write, SHA-256, agreement, publish) per GiB of
#     state, from dc-run's `saves`;
#   - resume (load): a resumed run's start-up (dc-run's startup_seconds: arena, host buffers and
#     every shard's first value) minus a fresh run's, per GiB: the checkpoint's reads and checks;
#   - step time with --save-every 1 against without: each measured step's wall with the save
#     after it (a save runs between steps, outside step_seconds) against a step without, as a
#     fraction of a step.
#   bench/checkpoint_bench.sh [build-dir] [model] [nproc] [steps] [repeats]
set -euo pipefail
build=${1:-build}
model=${2:-small}
nproc=${3:-2}
steps=${4:-8}
repeats=${5:-3}
bin="$build/tools"
work=$(mktemp -d /tmp/dc-bench-ckpt-XXXXXX)
trap 'rm -rf "$work"' EXIT

"$bin/dc-plan" --synthetic --model "$model" --world "$nproc" --hardware cpu --no-cache \
  -o "$work/p.dcplan" >/dev/null
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(uname -m)  model: $model  ranks: $nproc  steps: $steps (+1 warm-up)  repeats: $repeats"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
# Runs without and with a save after every step, alternating; then fresh and resumed 1-step
# runs (from the last saving run's checkpoint at step steps + 1), alternating.
for r in $(seq "$repeats"); do
  "$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --json >"$work/plain-$r.json"
  rm -rf "$work/ck"
  "$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --save "$work/ck" --save-every 1 \
    --keep 1 --json >"$work/saving-$r.json"
done
for r in $(seq "$repeats"); do
  "$bin/dc-run" "$work/p.dcplan" --steps 1 --json >"$work/fresh-$r.json"
  "$bin/dc-run" "$work/p.dcplan" --steps $((steps + 2)) --resume "$work/ck" --json \
    >"$work/resumed-$r.json"
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$work" "$repeats" <<'PY'
import json, statistics, sys
work, repeats = sys.argv[1], int(sys.argv[2])
def load(name):
    return [json.load(open(f"{work}/{name}-{r}.json")) for r in range(1, repeats + 1)]
plain, saving, fresh, resumed = load("plain"), load("saving"), load("fresh"), load("resumed")
median = statistics.median

state_bytes = saving[-1]["saves"][-1]["bytes"]
gib = state_bytes / 2**30
save_s = median(s["seconds"] for run in saving for s in run["saves"])
print(f"state: {state_bytes / 2**20:.1f} MiB over {plain[0]['world_size']} rank file(s)")

# A measured step's wall with its save: step_seconds[i] is step warmup + i + 1's, whose save
# is the one at that step.
def step_with_save(run):
    by_step = {s["step"]: s["seconds"] for s in run["saves"]}
    first = run["first_step"] + 2  # the warm-up step is step 1
    return median(t + by_step[first + i] for i, t in enumerate(run["step_seconds"]))
step = median(run["step_seconds_median"] for run in plain)
step_saving = median(step_with_save(run) for run in saving)
print(f"save: median {save_s:.3f} s = {save_s / gib:.2f} s/GiB = {save_s / step:.3f} of a step")
fresh_s = median(run["startup_seconds"] for run in fresh)
resumed_s = median(run["startup_seconds"] for run in resumed)
load_s = resumed_s - fresh_s
print(f"resume (load): start-up {resumed_s:.3f} s from the checkpoint, {fresh_s:.3f} s fresh: "
      f"{load_s:+.3f} s = {load_s / gib:+.2f} s/GiB")
print(f"step with --save-every 1: median {step_saving:.4f} s against {step:.4f} s without: "
      f"{(step_saving - step) / step:+.3f} of a step ({step_saving / step:.2f}x)")
for name, runs, key in (("step s, no save", plain, "step_seconds_median"),
                        ("startup s, fresh", fresh, "startup_seconds"),
                        ("startup s, resumed", resumed, "startup_seconds")):
    print(f"  per run, {name}: " + " ".join(f"{run[key]:.4f}" for run in runs))
print("  per run, step + save s: " + " ".join(f"{step_with_save(run):.4f}" for run in saving))
PY
