#!/usr/bin/env bash
# Set-up in one command: install the Debian packages that are missing, build, then
#   tools/setup.sh          run the main job: dc-collect -> dc-plan -> dc-run on `tiny`, 2 ranks
#   tools/setup.sh test     check the format (tools/format.sh --check), then run every test (ctest;
#                           python3-torch installed too, for the PyTorch parity tests)
#   tools/setup.sh build    build only
#   tools/setup.sh asan     build everything with ASan + UBSan (and float-cast-overflow, every report
#                           fatal) in build-asan/, then run every test under it
#   tools/setup.sh asan-readers  the same build of the tests of every reader of outside input only
#                           (traces, plans, weights, token files, the TCP rendezvous, the peers'
#                           shared memory), and run them;
#                           CI runs this after `test` (the whole tree under ASan would not fit its time)
#   tools/setup.sh fuzz [S] build the libFuzzer harnesses (fuzz/, clang) in build-fuzz/ and run each
#                           for S seconds (default 60) from its seed corpus in fuzz/corpus/
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-demo}
jobs=${DC_JOBS:-$(nproc)}
# The readers of outside input, for asan-readers: their tests' binaries.
asan_readers=(schemas_test plan_check_test weights_test analyzer_test data_test tcp_store_test comm_test)

case "$mode" in
  asan | asan-readers) build_dir=${DC_BUILD_DIR:-build-asan} ;;
  fuzz) build_dir=${DC_BUILD_DIR:-build-fuzz} ;;
  *) build_dir=${DC_BUILD_DIR:-build} ;;
esac

packages=(build-essential cmake pkg-config libprotobuf-dev protobuf-compiler libsqlite3-dev sqlite3
          libcli11-dev libgtest-dev libgloo-dev libopenblas-dev libssl-dev nlohmann-json3-dev zlib1g-dev
          libmimalloc-dev clang-format python3)
# libFuzzer ships with clang.
if [ "$mode" = fuzz ]; then packages+=(clang); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The test mode also runs the PyTorch parity tests (tests/torch_reference), which skip without it.
if [ "$mode" = test ]; then
  dpkg-query -W -f='${Status}' python3-torch 2>/dev/null | grep -q "install ok installed" ||
    missing+=(python3-torch)
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The format check first: it takes a second, the build minutes.
if [ "$mode" = test ]; then tools/format.sh --check; fi

case "$mode" in
  asan | asan-readers)
    # The CUDA path is left out: the CUDA runtime and ASan's shadow memory need special settings,
    # and the GPU tests skip without a device anyway.
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDC_SANITIZE=ON -DDC_CUDA=OFF \
      >/dev/null
    if [ "$mode" = asan ]; then
      cmake --build "$build_dir" -j "$jobs"
    else
      cmake --build "$build_dir" -j "$jobs" --target "${asan_readers[@]}"
    fi
    ;;
  fuzz)
    # clang's warnings are not GCC's, which CI holds at -Werror; the fuzz build does not.
    CC=clang CXX=clang++ cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DDC_FUZZERS=ON -DDC_BUILD_TESTS=OFF -DDC_WERROR=OFF -DDC_CUDA=OFF >/dev/null
    cmake --build "$build_dir" -j "$jobs" --target dc_fuzzers
    ;;
  *)
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$build_dir" -j "$jobs"
    ;;
esac

case "$mode" in
  build) ;;
  test)
    cd "$build_dir"
    ctest --output-on-failure -j "$jobs" --timeout 600
    ;;
  asan-readers)
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
    for test in "${asan_readers[@]}"; do
      binary=$(find "$build_dir" -name "$test" -type f -perm -u+x | head -1)
      echo "== $test (ASan + UBSan)"
      (cd "$(dirname "$binary")" && "./$test" --gtest_brief=1)
    done
    ;;
  asan)
    cd "$build_dir"
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
    # Slower under the sanitizers: a longer limit per test.
    ctest --output-on-failure -j "$jobs" --timeout 1800
    ;;
  fuzz)
    seconds=${2:-60}
    for fuzzer in "$build_dir"/fuzz/*_fuzzer; do
      name=$(basename "$fuzzer" _fuzzer)
      work="$build_dir/fuzz/corpus/$name" artifacts="$build_dir/fuzz/artifacts/$name"
      mkdir -p "$work" "$artifacts"
      echo "== $name: $seconds s"
      # New inputs go to the work corpus; the seeds in the tree are only read.
      "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$artifacts/" \
        "$work" "fuzz/corpus/$name"
    done
    ;;
  demo)
    work=$(mktemp -d /tmp/dc-demo-XXXXXX)
    bin="$build_dir/tools"
    echo "== dc-collect: record 3 steps of tiny on 2 ranks (cpu backend)"
    "$bin/dc-collect" --backend cpu --model tiny --nproc 2 --steps 3 --warmup 1 -o "$work/trace.db"
    echo "== dc-plan: profile the trace and plan"
    "$bin/dc-plan" "$work/trace.db" -o "$work/plan.dcplan" --cache-dir "$work/cache" --report
    echo "== dc-run: train 20 steps by the plan"
    "$bin/dc-run" --backend cpu "$work/plan.dcplan" --steps 20
    echo "(files in $work)"
    ;;
  *) echo "usage: tools/setup.sh [demo|test|build|asan|fuzz [seconds]]" >&2; exit 2 ;;
esac
