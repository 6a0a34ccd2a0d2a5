#!/usr/bin/env python3
"""CTest's server_test: runs the pytest suite next to this file. Exits 77 (CTest: Skipped),
saying why, when the official openai package, pytest or the real tokenizer is missing."""

import importlib.util
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main():
    for module, package in [("openai", "openai"), ("pytest", "pytest")]:
        if importlib.util.find_spec(module) is None:
            print(f"server_test skipped: the Python package '{package}' is missing "
                  f"(python3 -m pip install {package}; scripts/setup.sh installs it)")
            return 77
    tok = pathlib.Path(os.environ.get(
        "DSV4_TOKENIZER_DIR", HERE.parents[1].parent / "shared" / "tokenizer" / "deepseek-v4"))
    if not (tok / "tokenizer.json").exists():
        print(f"server_test skipped: no tokenizer.json in {tok} (set DSV4_TOKENIZER_DIR)")
        return 77
    import pytest
    rc = pytest.main([str(HERE), "-q", "-p", "no:cacheprovider", "-rxXs", *sys.argv[1:]])
    return 1 if rc == 5 else int(rc)  # 5: no test ran, which is a failure here


if __name__ == "__main__":
    sys.exit(main())
