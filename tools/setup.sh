#!/usr/bin/env bash
# Set-up in one command: install the Debian packages that are missing, build, then
#   tools/setup.sh          run the main job: dc-collect -> dc-plan -> dc-run on `tiny`, 2 ranks
#   tools/setup.sh test     check the format (tools/format.sh --check), then run every test (ctest;
#                           python3-torch installed too, for the PyTorch parity tests)
#   tools/setup.sh build    build only
#   tools/setup.sh fuzz [S] build the libFuzzer harnesses (clang, build-fuzz/) and run each for S
#                           seconds (default 60) over a scratch copy of its seed corpus
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-demo}
build_dir=${DC_BUILD_DIR:-build}
jobs=${DC_JOBS:-$(nproc)}

packages=(build-essential cmake pkg-config libprotobuf-dev protobuf-compiler libsqlite3-dev sqlite3
          libcli11-dev libgtest-dev libgloo-dev libopenblas-dev libssl-dev nlohmann-json3-dev zlib1g-dev
          libmimalloc-dev clang-format python3)
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

if [ "$mode" = fuzz ]; then
  command -v clang++ >/dev/null || { echo "setup: fuzz needs clang (apt-get install clang)" >&2; exit 2; }
  seconds=${2:-60}
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -DDC_FUZZERS=ON -DDC_CUDA=OFF -DDC_BUILD_TESTS=OFF \
    -DDC_WERROR=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  fuzzers=()
  for f in fuzz/*_fuzzer.cc; do fuzzers+=("$(basename "$f" .cc)"); done
  cmake --build build-fuzz -j "$jobs" --target "${fuzzers[@]}"
  for name in "${fuzzers[@]}"; do
    corpus=$(mktemp -d /tmp/dc-fuzz-corpus-XXXXXX)
    cp -r "fuzz/corpus/${name%_fuzzer}/." "$corpus/" 2>/dev/null || true
    echo "== $name: $seconds s"
    mkdir -p build-fuzz/artifacts
    "build-fuzz/fuzz/$name" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$name-" "$corpus"
    rm -rf "$corpus"
  done
  exit 0
fi

# The format check first: it takes a second, the build minutes.
if [ "$mode" = test ]; then tools/format.sh --check; fi

cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j "$jobs"

case "$mode" in
  build) ;;
  test)
    cd "$build_dir"
    ctest --output-on-failure -j "$jobs" --timeout 600
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
  *) echo "usage: tools/setup.sh [demo|test|build|fuzz [seconds]]" >&2; exit 2 ;;
esac
