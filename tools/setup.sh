#!/usr/bin/env bash
# Set-up in one command: install the Debian packages that are missing, build, then
#   tools/setup.sh          run the main job: dc-collect -> dc-plan -> dc-run on `tiny`, 2 ranks
#   tools/setup.sh test     check the format (tools/format.sh --check), then run every test (ctest;
#                           python3-torch installed too, for the PyTorch parity tests)
#   tools/setup.sh build    build only
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
  *) echo "usage: tools/setup.sh [demo|test|build]" >&2; exit 2 ;;
esac
