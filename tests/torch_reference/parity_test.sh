#!/bin/sh
# ctest entry of the PyTorch parity tests: skips (exit 77) with one line where the system
# python has no torch, else runs parity_test.py with the same arguments.
PY=/usr/bin/python3
if ! [ -x "$PY" ] || ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "SKIP: PyTorch parity needs torch for /usr/bin/python3: apt-get install python3-torch"
  exit 77
fi
exec "$PY" "$(dirname "$0")/parity_test.py" "$@"
