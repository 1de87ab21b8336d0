#!/usr/bin/env python3
"""dc's layering, checked: every #include "folder/..." in a library's own sources (tests and
tools excepted) must come from a folder that library may depend on (ARCHITECTURE.md, "The flow").
Exits non-zero with one line per include that breaks it.

    tools/check_layers.py [source root]
"""
import pathlib
import re
import sys

# What each library folder's own sources may include, besides themselves.
ALLOWED = {
    "schemas": set(),
    "models": {"schemas"},
    "machine": {"schemas"},
    # Weights in outside formats: the program's names and shapes, the models' param names.
    "weights": {"schemas", "models/param_names.h"},
    "analyzer": {"schemas", "machine"},
    "rewriter": {"schemas", "machine"},
    # The collectors implement the executor's tracer interface, and nothing else of it.
    "collector": {"schemas", "executor/tracer.h"},
    # The backends' wiring makes their tracers (collector/); the initializer names the params
    # the builder made (models/param_names.h, models/random.h).
    "executor": {"schemas", "collector", "weights", "models/param_names.h", "models/random.h"},
    "tracetools": {"schemas", "machine", "analyzer"},
    # dc-calibrate's step-time input: configurations built (models/) and planned (rewriter/).
    "calibrate": {"schemas", "machine", "models", "rewriter"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def allowed(folder, header):
    top = header.split("/", 1)[0]
    if top == folder or top not in ALLOWED:
        return True
    rules = ALLOWED[folder]
    return top in rules or header in rules


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    broken = []
    checked = 0
    for folder in ALLOWED:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in {".h", ".cc", ".cu", ".cuh", ".in"}:
                continue
            name = path.name
            if name.endswith("_test.cc") or "test" in path.parent.name:
                continue
            checked += 1
            text = path.read_text(errors="replace")
            for match in INCLUDE.finditer(text):
                header = match.group(1)
                if not allowed(folder, header):
                    line = text.count("\n", 0, match.start()) + 1
                    broken.append(f"{path.relative_to(root)}:{line}: {folder}/ may not include "
                                  f"{header} (ARCHITECTURE.md, The flow)")
    for b in broken:
        print(b)
    if broken:
        return 1
    print(f"layers: {checked} library sources include only what their folder may use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
