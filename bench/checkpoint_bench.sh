#!/usr/bin/env bash
# What checkpoints cost on the cpu backend, from alternated runs (the machine is shared and
# noisy, so every figure is a median and the comparisons are within one invocation):
#   - save, blocking: what a save holds the training thread for (dc-run's
#     saves[].blocking_seconds: the snapshot of the rank's state into host memory, the wait for
#     the previous save's writer at the next save point, the agreement over the ranks and rank 0's
#     publish), per GiB of state and as a fraction of a step without saves;
#   - save, background: rank 0's writer thread (saves[].background_seconds: serializing,
#     writing, fsyncing and hashing its shard file while the next step trains), the same ways;
#   - the same with --save-blocking (the whole write between steps, as before 2026-11-27);
#   - resume (load): a resumed run's start-up (dc-run's startup_seconds: arena, host buffers and
#     every shard's first value, here read and checked from the checkpoint) per GiB;
#   - step time with --save-every 1 against without: each measured step's wall plus the
#     training thread's blocking time of the save after it (a save point runs between steps,
#     outside step_seconds; the background write slows the step it overlaps, inside them),
#     against a step without, as a fraction of a step: the median over alternated runs.
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
# Runs without saves, with a save after every step, and with one written between steps
# (--save-blocking), alternating; then fresh and resumed 1-step runs (from the last saving run's
# checkpoint at step steps + 1), alternating.
for r in $(seq "$repeats"); do
  "$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --json >"$work/plain-$r.json"
  rm -rf "$work/ckb"
  "$bin/dc-run" "$work/p.dcplan" --steps "$steps" --warmup 1 --save "$work/ckb" --save-every 1 \
    --keep 1 --save-blocking --json >"$work/blocking-$r.json"
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
plain, saving, blocking = load("plain"), load("saving"), load("blocking")
fresh, resumed = load("fresh"), load("resumed")
median = statistics.median

state_bytes = saving[-1]["saves"][-1]["bytes"]
gib = state_bytes / 2**30
step = median(run["step_seconds_median"] for run in plain)
print(f"state: {state_bytes / 2**20:.1f} MiB over {plain[0]['world_size']} rank file(s); "
      f"a step without saves: median {step:.3f} s")
def figure(name, runs, key):
    value = median(s[key] for run in runs for s in run["saves"])
    print(f"{name}: median {value:.3f} s = {value / gib:.2f} s/GiB = {value / step:.3f} of a step")
figure("save (background), blocking the training thread", saving, "blocking_seconds")
figure("save (background), the writer thread", saving, "background_seconds")
figure("save (background), snapshot to publish", saving, "seconds")
figure("save (--save-blocking), blocking the training thread", blocking, "blocking_seconds")

# A measured step's wall with the blocking time of its save: step_seconds[i] is step
# warmup + i + 1's, whose save is the one at that step (the final step's save is waited for at
# the end of the run, outside the steps: it is left out).
def step_with_save(run):
    by_step = {s["step"]: s["blocking_seconds"] for s in run["saves"]}
    first = run["first_step"] + 2  # the warm-up step is step 1
    return median(t + by_step[first + i] for i, t in enumerate(run["step_seconds"][:-1]))
# A resumed start-up reads and checks the checkpoint instead of computing the seeded init: it is
# the resume's whole cost (the arena and host buffers, the same in both, are small beside it).
fresh_s = median(run["startup_seconds"] for run in fresh)
resumed_s = median(run["startup_seconds"] for run in resumed)
print(f"resume (load): start-up {resumed_s:.3f} s from the checkpoint = {resumed_s / gib:.2f} s/GiB "
      f"(a fresh start-up, computing the seeded init instead: {fresh_s:.3f} s)")
# Each saving run against the run without of the same round (alternated: they share the load).
for name, runs in (("background", saving), ("--save-blocking", blocking)):
    ratios = [step_with_save(s) / p["step_seconds_median"] for p, s in zip(plain, runs)]
    print(f"step with --save-every 1 ({name}) over without: median {median(ratios):.2f}x of the "
          f"alternated rounds = {median(ratios) - 1:+.3f} of a step; per round: " +
          " ".join(f"{r:.2f}" for r in ratios))
for name, runs, key in (("step s, no save", plain, "step_seconds_median"),
                        ("step s, background saves", saving, "step_seconds_median"),
                        ("step s, --save-blocking", blocking, "step_seconds_median"),
                        ("startup s, fresh", fresh, "startup_seconds"),
                        ("startup s, resumed", resumed, "startup_seconds")):
    print(f"  per run, {name}: " + " ".join(f"{run[key]:.4f}" for run in runs))
for name, runs in (("background", saving), ("--save-blocking", blocking)):
    print(f"  per run, step + blocking s ({name}): " +
          " ".join(f"{step_with_save(run):.4f}" for run in runs))
PY
