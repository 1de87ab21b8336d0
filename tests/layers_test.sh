#!/bin/sh
# tools/check_layers.py passes on the tree, and fails, naming the file and the header, on a copy
# of it where a schemas/ header includes the rewriter.
set -eu
root=$1
python3 "$root/tools/check_layers.py" "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/schemas"
cp "$root/schemas/units.h" "$tmp/schemas/units.h"
echo '#include "rewriter/pass.h"' >>"$tmp/schemas/units.h"
if out=$(python3 "$root/tools/check_layers.py" "$tmp"); then
  echo "check_layers.py accepted schemas/ including rewriter/" >&2
  exit 1
fi
echo "$out" | grep -q 'schemas/units.h:[0-9]*: schemas/ may not include rewriter/pass.h' || {
  echo "unexpected message: $out" >&2
  exit 1
}
echo "layers: a violation is refused"
