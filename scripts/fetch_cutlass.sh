#!/usr/bin/env bash
# Puts the CUTLASS/CuTe headers (from the nvidia-cutlass wheel on PyPI) into .cutlass/include,
# where the CUDA build finds them. Git-ignored; carried to the H200 with the working tree
# (scripts/h200/run.sh), whose image has no CUTLASS.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${DSV4_CUTLASS_VERSION:-4.2.0.0}"
if [ -f .cutlass/include/cutlass/version.h ] && [ "$(cat .cutlass/VERSION 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-cutlass==$VERSION" -d "$tmp"
python3 - "$tmp" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "nvidia_cutlass-*.whl"))[0]
prefix = "cutlass_library/source/include/"
shutil.rmtree(".cutlass", ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            dest = os.path.join(".cutlass/include", name[len(prefix):])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(name) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
PY
echo "$VERSION" > .cutlass/VERSION
echo "CUTLASS $VERSION headers in .cutlass/include"
