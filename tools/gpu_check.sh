#!/usr/bin/env bash
# tools/gpu_check.sh: the GPU checks of a build made elsewhere, on a GPU host without Debian's
# dev packages (the bundle build: tools/gpu_pack.sh packs it into one folder).
#
#   tools/gpu_check.sh PACK OUT [tests|pipeline|parity|speed|all]
#
# PACK is the folder tools/gpu_pack.sh wrote (the build tree's layout: tools/, lib/, the tests);
# a link from the build tree's path (PACK/BUILD_PATH) to PACK is made where that path is free,
# since the tests name dc-run and the CUPTI test program by it. OUT receives one log per check. Each gtest binary
# labelled gpu runs on its own; then the pipeline: dc-plan a cuda plan, dc-run it, the same plan
# on the cpu backend, dc-collect under CUPTI, dc-trace summary, dc-plan from the GPU trace and
# dc-run of that plan. Prints one PASS/FAIL line per check and exits non-zero on any FAIL.
set -uo pipefail

pack=$(cd "${1:?usage: gpu_check.sh PACK OUT [tests|pipeline|parity|speed|all]}" && pwd)
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
  cp "$work"/*.dcplan "$out"/ 2>/dev/null
  rm -rf "$work"
fi

if [ "$what" = parity ] || [ "$what" = all ]; then
  # The cuda kernels against the float64 PyTorch reference (tests/torch_reference).
  root=$(cd "$(dirname "$0")/.." && pwd)
  for preset in tiny mixtral-tiny; do
    check "parity_${preset}_cuda" python3 "$root/tests/torch_reference/parity_test.py" "$pack" \
      "$preset" 1 2 --backend cuda
  done
fi

if [ "$what" = speed ] || [ "$what" = all ]; then
  # One GPU, bf16: a 1B Llama's step time under the baseline plan and dc's.
  bin=$pack/tools
  work=$(mktemp -d)
  model=(--model llama-1b --seq 2048 --micro-batch 4 --gas 1 --world 1 --hardware h100-sxm)
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
exit $failed
