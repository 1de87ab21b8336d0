#!/usr/bin/env bash
# tools/gpu_check.sh: the GPU checks of a build made elsewhere, on a GPU host without Debian's
# dev packages (the bundle build: tools/gpu_pack.sh packs it into one folder).
#
#   tools/gpu_check.sh PACK OUT [tests|pipeline|parity|speed|all|profile]
#
# PACK is the folder tools/gpu_pack.sh wrote (the build tree's layout: tools/, lib/, the tests);
# a link from the build tree's path (PACK/BUILD_PATH) to PACK is made where that path is free,
# since the tests name dc-run and the CUPTI test program by it. OUT receives one log per check. Each gtest binary
# labelled gpu runs on its own; then the pipeline: dc-plan a cuda plan, dc-run it, the same plan
# on the cpu backend, dc-collect under CUPTI, dc-trace summary, dc-plan from the GPU trace and
# dc-run of that plan. Prints one PASS/FAIL line per check and exits non-zero on any FAIL.
# `profile` (not part of all): where a 1B Llama's GPU step goes, as each kernel alone
# (GpuBench), as the trace of a dc-run (the top kernels) and as the trace against the plan's
# prediction (dc-trace diff: the instructions furthest from it); the trace and plan land in OUT.
set -uo pipefail

pack=$(cd "${1:?usage: gpu_check.sh PACK OUT [tests|pipeline|parity|speed|all|profile]}" && pwd)
out=$(mkdir -p "${2:?usage: gpu_check.sh PACK OUT}" && cd "$2" && pwd)
what=${3:-all}
failed=0

# CUDA 13's libraries: the toolkit's, or the ones PyTorch's wheels carry.
libs=()
for dir in /usr/local/cuda/lib64 /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && libs+=("$dir")
done
for name in libnccl.so.2 libcublasLt.so.13 libcupti.so.13; do
  found=""
  for dir in "${libs[@]}"; do [ -e "$dir/$name" ] && found=1; done
  [ -n "$found" ] && continue
  path=$(find / -xdev -name "$name" -not -path '/proc/*' 2>/dev/null | head -1)
  [ -n "$path" ] && libs+=("$(dirname "$path")")
done
LD_LIBRARY_PATH=$(IFS=:; echo "$pack/lib:${libs[*]}:${LD_LIBRARY_PATH:-}")
export LD_LIBRARY_PATH
echo "gpu_check: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
build_path=$(cat "$pack/BUILD_PATH")
if [ ! -e "$build_path" ]; then
  mkdir -p "$(dirname "$build_path")" && ln -s "$pack" "$build_path"
fi
nvidia-smi -L 2>&1 | head -4

check() {  # check NAME COMMAND...: runs it, log in OUT/NAME.log
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s, exit $?): $(grep -m3 -E 'Failure|error|FAILED|dc-' "$out/$name.log" | tr '\n' ' ' | cut -c1-400)"
    failed=1
  fi
}

losses_equal() {  # losses_equal LOG...: each log's last JSON line; the last losses of the first
  # (as many as the shortest run has) must equal every other's, bit for bit
  python3 - "$@" <<'PY'
import json, sys
runs = []
for path in sys.argv[1:]:
    lines = [l for l in open(path) if l.startswith("{")]
    runs.append((path, json.loads(lines[-1])["losses"]))
n = min(len(losses) for _, losses in runs)
first = runs[0][1][-n:]
print("losses", runs[0][0], first)
bad = 0
for path, losses in runs[1:]:
    diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(first, losses[-n:]))
    print("largest relative difference", path, diff, losses[-n:])
    bad |= diff != 0
sys.exit(bad)
PY
}

if [ "$what" = tests ] || [ "$what" = all ]; then
  for test in $(find "$pack" -name '*_test' -type f | sort); do
    [ -x "$test" ] || continue
    name=$(basename "$test")
    check "$name" timeout 300 "$test" --gtest_color=no
    grep -E '^\[  (FAILED|SKIPPED) ' "$out/$name.log" | sort -u | head -20
  done
fi

if [ "$what" = pipeline ] || [ "$what" = all ]; then
  bin=$pack/tools
  work=$(mktemp -d)
  check plan_tiny "$bin/dc-plan" --synthetic --model tiny --world 1 --hardware h100-sxm -o "$work/tiny.dcplan"
  check run_tiny_cuda "$bin/dc-run" "$work/tiny.dcplan" --steps 20 --backend cuda --json
  check collect_tiny_cuda "$bin/dc-collect" --backend cuda --model tiny --steps 5 --warmup 1 -o "$work/tiny.db"
  check trace_summary "$bin/dc-trace" summary "$work/tiny.db"
  check plan_from_gpu_trace "$bin/dc-plan" "$work/tiny.db" -o "$work/tiny-traced.dcplan" --explain
  check run_traced_plan "$bin/dc-run" "$work/tiny-traced.dcplan" --steps 20 --json
  # The same model under three schedules on the GPU: the baseline, dc's plan and a plan squeezed
  # to 1.6 MiB (host Adam, offloaded optimizer state, the memory-plan arena) must train to the
  # same losses. Then a run saved at step 5 and resumed to 10 must end where a run of 10 ends.
  tiny=(--synthetic --model tiny --world 1 --hardware h100-sxm)
  check plan_tiny_baseline "$bin/dc-plan" "${tiny[@]}" --policy baseline -o "$work/tiny-baseline.dcplan"
  check plan_tiny_offload "$bin/dc-plan" "${tiny[@]}" --budget 1.6MiB -o "$work/tiny-offload.dcplan" --explain
  for plan in tiny tiny-baseline tiny-offload; do
    check "run10_$plan" "$bin/dc-run" "$work/$plan.dcplan" --steps 10 --backend cuda --json --quiet
  done
  check same_losses_across_plans losses_equal "$out/run10_tiny.log" "$out/run10_tiny-baseline.log" \
    "$out/run10_tiny-offload.log"
  check save_at_5 "$bin/dc-run" "$work/tiny-offload.dcplan" --steps 5 --backend cuda --save "$work/ck" --json --quiet
  check resume_to_10 "$bin/dc-run" "$work/tiny-offload.dcplan" --steps 10 --backend cuda --resume "$work/ck" \
    --json --quiet
  check resumed_losses_equal losses_equal "$out/run10_tiny-offload.log" "$out/resume_to_10.log"
  # A collection killed outright keeps the steps it committed (the CUPTI writer streams).
  "$bin/dc-collect" --backend cuda --model tiny --steps 100000 -o "$work/killed.db" \
    >"$out/collect_killed.log" 2>&1 &
  collector=$!
  sleep 8
  kill -9 "$collector" 2>/dev/null
  wait "$collector" 2>/dev/null
  check merge_killed_collection "$bin/dc-trace" merge "$work/killed.db.rank0.part" -o "$work/killed.db"
  check killed_trace_is_incomplete sh -c "'$bin/dc-trace' summary '$work/killed.db' | grep incomplete"
  cp "$work"/*.dcplan "$out"/ 2>/dev/null
  rm -rf "$work"
fi

if [ "$what" = parity ] || [ "$what" = all ]; then
  # The cuda kernels against the float64 PyTorch reference (tests/torch_reference).
  root=$(cd "$(dirname "$0")/.." && pwd)
  # In fp32 to the reference's fixed tolerances; in bf16 to twice PyTorch's own bf16 differences.
  for preset in tiny mixtral-tiny; do
    check "parity_${preset}_cuda" python3 "$root/tests/torch_reference/parity_test.py" "$pack" \
      "$preset" 1 2 --backend cuda
    check "parity_${preset}_cuda_bf16" python3 "$root/tests/torch_reference/parity_test.py" \
      "$pack" "$preset" 1 2 --backend cuda --dtype bf16
    tail -n 8 "$out/parity_${preset}_cuda_bf16.log"
  done
fi

# One GPU, bf16: a 1B Llama (PyTorch's figure below is for the same shapes).
model=(--model llama-1b --seq 2048 --micro-batch 4 --gas 1 --world 1 --hardware h100-sxm)

if [ "$what" = speed ] || [ "$what" = all ]; then
  # The 1B Llama's step time under the baseline plan and dc's.
  bin=$pack/tools
  work=$(mktemp -d)
  for policy in baseline dc; do
    check "plan_1b_$policy" "$bin/dc-plan" --synthetic "${model[@]}" --policy "$policy" \
      -o "$work/1b-$policy.dcplan"
    check "run_1b_$policy" "$bin/dc-run" "$work/1b-$policy.dcplan" --steps 10 --warmup 3 --json --quiet
    tail -c 600 "$out/run_1b_$policy.log"; echo
  done
  rm -rf "$work"
  # The same model and batch in PyTorch eager (bf16 autocast, SDPA, fused AdamW).
  root=$(cd "$(dirname "$0")/.." && pwd)
  check torch_1b python3 "$root/bench/torch_peer.py" --device cuda --dtype bf16 --layers 16 \
    --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 2048 --micro-batch 4 \
    --steps 10 --warmup 3
  tail -c 400 "$out/torch_1b.log"; echo
fi
if [ "$what" = profile ]; then
  bin=$pack/tools
  work=$(mktemp -d)
  DC_GPU_BENCH=1 check kernel_bench "$pack/executor/cuda/cuda_kernels_test" --gtest_filter='GpuBench.*'
  grep '^bench' "$out/kernel_bench.log"
  check plan_1b_profiled "$bin/dc-plan" --synthetic "${model[@]}" --policy dc -o "$work/1b.dcplan"
  check run_1b_traced "$bin/dc-run" "$work/1b.dcplan" --steps 10 --warmup 3 --trace "$work/1b.db" --json --quiet
  tail -c 600 "$out/run_1b_traced.log"; echo
  check trace_1b "$bin/dc-trace" summary "$work/1b.db"
  check diff_1b "$bin/dc-trace" diff "$work/1b.db" "$work/1b.dcplan"
  check kernels_1b python3 - "$work/1b.db" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows = db.execute("""SELECT s.value, COUNT(*), SUM(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k
                     JOIN StringIds s ON s.id = k.shortName GROUP BY s.value ORDER BY 3 DESC""").fetchall()
total = sum(r[2] for r in rows)
print(f"kernel time {total / 1e6:.3f} ms over {sum(r[1] for r in rows)} launches")
for name, count, ns in rows[:40]:
    print(f"{ns / 1e6:10.3f} ms {100.0 * ns / total:5.1f}% {count:6d}x  {name[:110]}")
PY
  head -50 "$out/kernels_1b.log"
  # The trace and its plan, for dc-calibrate and dc-trace on another machine.
  cp "$work/1b.db" "$work/1b.dcplan" "$out/" 2>/dev/null
  rm -rf "$work"
fi
exit $failed
