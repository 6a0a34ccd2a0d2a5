#!/usr/bin/env python3
"""Checks that every #include "..." in src/, include/ and tools/ points down the layer map.

The map (README, "Architecture"): core, io -> kvcache -> ops/{cpu,cuda} -> model ->
backends/{cpu,cuda} -> runtime -> server, tools; tokenizer and comm on core alone. A file may
include its own layer and the layers listed for it below, nothing else. Exit 0 when clean,
1 listing every offending include. `--self-test` checks that a planted violation is caught.
"""
import pathlib
import re
import sys

ALLOWED = {
    "core": set(),
    "io": {"core"},
    "kvcache": {"core"},
    "comm": {"core"},
    "tokenizer": {"core"},
    "ops/common": {"core", "io"},
    "ops/cpu": {"core", "io", "kvcache", "ops/common"},
    "ops/cuda": {"core", "io", "kvcache", "ops/common"},
    "model": {"core", "io", "kvcache", "ops/common"},
    "backends/cpu": {"core", "io", "kvcache", "comm", "ops/common", "ops/cpu", "model"},
    "backends/cuda": {"core", "io", "kvcache", "comm", "ops/common", "ops/cpu", "ops/cuda", "model",
                      "backends/cpu"},
    # The public API (include/dsv4) is implemented by the runtime.
    "api": set(),
    "runtime": {"core", "io", "kvcache", "comm", "ops/common", "model", "backends/cpu", "api"},
    # The HTTP layer never touches tensors: it sees the public engine API and the tokenizer.
    "server": {"core", "api", "tokenizer"},
    "tools": {"core", "io", "kvcache", "comm", "ops/common", "ops/cpu", "model", "backends/cpu",
              "backends/cuda", "runtime", "api", "server", "tokenizer"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of_file(rel):
    parts = rel.split("/")
    if parts[0] == "include":
        return "api"
    if parts[0] == "tools":
        return "tools"
    if parts[0] != "src" or len(parts) < 3:
        return None
    if parts[1] in ("ops", "backends"):
        return parts[1] + "/" + parts[2] if len(parts) > 3 else None
    return parts[1]


def layer_of_include(inc, including_layer):
    parts = inc.split("/")
    if parts[0] == "dsv4":
        return "api"
    if parts[0] in ("ops", "backends") and len(parts) > 2:
        return parts[0] + "/" + parts[1]
    if parts[0] in ALLOWED:
        return parts[0]
    # Relative includes inside a folder (tools/, tests' own headers) stay in their layer.
    return including_layer


def check(files):
    bad = []
    for rel, text in files:
        layer = layer_of_file(rel)
        if layer is None:
            continue
        if layer not in ALLOWED:
            bad.append(f"{rel}: folder '{layer}' is not in the layer map (scripts/check_layers.py)")
            continue
        for inc in INCLUDE.findall(text):
            target = layer_of_include(inc, layer)
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"{rel}: includes \"{inc}\" ({target}); {layer} may include only "
                           f"{', '.join(sorted(ALLOWED[layer] | {layer})) }")
    return bad


def tree_files(root):
    out = []
    for top in ("src", "include", "tools"):
        for p in sorted((root / top).rglob("*")):
            if p.suffix in (".h", ".cpp", ".cu", ".cuh", ".inc") and p.is_file():
                out.append((p.relative_to(root).as_posix(), p.read_text(errors="replace")))
    return out


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    if "--self-test" in sys.argv:
        planted = [("src/ops/cpu/x.cpp", '#include "model/model_config.h"\n'),
                   ("src/kvcache/y.h", '#include "backends/cpu/runner.h"\n'),
                   ("src/server/z.cpp", '#include "backends/cpu/model.h"\n'),
                   ("src/model/ok.cpp", '#include "kvcache/block_manager.h"\n')]
        found = check(planted)
        if len(found) != 3 or any("ok.cpp" in f for f in found):
            print("self-test failed:", *found, sep="\n  ")
            return 1
        print("self-test: 3 planted upward includes caught, 1 downward include allowed")
    bad = check(tree_files(root))
    for b in bad:
        print(b)
    if bad:
        print(f"{len(bad)} include(s) point up the layer map")
        return 1
    print("layering: every include points down the layer map")
    return 0


if __name__ == "__main__":
    sys.exit(main())
