#!/usr/bin/env bash
# The tree's C++ and CUDA sources in .clang-format's style (clang-format 14, Debian's):
#   tools/format.sh           format every tracked source in place
#   tools/format.sh --check   list the sources that differ and exit 1 if any does (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-fix}
case "$mode" in
  fix|--check) ;;
  *) echo "usage: tools/format.sh [--check]" >&2; exit 2 ;;
esac
command -v clang-format >/dev/null || { echo "format: clang-format is not installed; run tools/setup.sh" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "$mode" = fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
differ=()
for f in "${files[@]}"; do
  clang-format "$f" | cmp -s - "$f" || differ+=("$f")
done
if ((${#differ[@]})); then
  echo "format: ${#differ[@]} file(s) differ from .clang-format; run tools/format.sh:" >&2
  printf '  %s\n' "${differ[@]}" >&2
  exit 1
fi
echo "format: ${#files[@]} sources match .clang-format"
