#!/usr/bin/env bash
# What checkpoints cost on the cpu backend, from alternated runs (the machine is shared and
# noisy, so every figure is a median and the comparisons are within one invocation):
#   - save: a save's wall seconds (every rank's write, SHA-256, agreement, publish) per GiB of
#     state, from dc-run's `saves`;
#   - resume (load): a resumed run's start-up (dc-run's startup_seconds: arena, host buffers and
#     every shard's first value, here read and checked from the checkpoint) per GiB;
#   - step time with --save-every 1 against without: each measured step's wall with the save
#     after it (a save runs between steps, outside step_seconds) against a step without, as a
#     fraction of a step: the median over pairs of runs, one of each, run one after the other.
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
print(f"save: median {save_s:.3f} s = {save_s / gib:.2f} s/GiB = {save_s / step:.3f} of a step")
# A resumed start-up reads and checks the checkpoint instead of computing the seeded init: it is
# the resume's whole cost (the arena and host buffers, the same in both, are small beside it).
fresh_s = median(run["startup_seconds"] for run in fresh)
resumed_s = median(run["startup_seconds"] for run in resumed)
print(f"resume (load): start-up {resumed_s:.3f} s from the checkpoint = {resumed_s / gib:.2f} s/GiB "
      f"(a fresh start-up, computing the seeded init instead: {fresh_s:.3f} s)")
# Each saving run against the run without just before it (alternated: they share the load).
ratios = [step_with_save(s) / p["step_seconds_median"] for p, s in zip(plain, saving)]
in_run = [median(x["seconds"] for x in s["saves"]) / s["step_seconds_median"] for s in saving]
print(f"step with --save-every 1 over without: median {median(ratios):.2f}x of the alternated "
      f"pairs = {median(ratios) - 1:+.3f} of a step (within the saving runs: a save is "
      f"{median(in_run):.3f} of their step)")
for name, runs, key in (("step s, no save", plain, "step_seconds_median"),
                        ("step s, saving runs", saving, "step_seconds_median"),
                        ("startup s, fresh", fresh, "startup_seconds"),
                        ("startup s, resumed", resumed, "startup_seconds")):
    print(f"  per run, {name}: " + " ".join(f"{run[key]:.4f}" for run in runs))
print("  per run, step + save s: " + " ".join(f"{step_with_save(run):.4f}" for run in saving))
print("  per pair, ratio: " + " ".join(f"{r:.2f}" for r in ratios))
PY
