#!/usr/bin/env bash
# Installs dc into a temporary prefix and builds a separate project against find_package(dc).
#   install_test.sh BUILD_DIR SOURCE_DIR [FLAGS]   FLAGS: the sanitizer flags dc was built with
set -euo pipefail
build_dir=$1
source_dir=$2
flags=${3:-}
prefix=$(mktemp -d /tmp/dc-install-XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
test -x "$prefix/bin/dc-collect" && test -x "$prefix/bin/dc-plan" && test -x "$prefix/bin/dc-run"
cmake -S "$source_dir/tests/install_consumer" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
"$prefix/consumer/consumer" | grep -q "planned [0-9]* instructions"
echo "installed package works"
