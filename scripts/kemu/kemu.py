#!/usr/bin/env python3
"""kemu: build and run dsv4's GPU tests on the CPU, through an emulator of the CUDA features the
kernels use (README.md here says what is emulated and what is not).

  scripts/kemu/kemu.py moe_test [--gtest_filter=...]      build tests/cuda/moe_test.cpp, run it
  scripts/kemu/kemu.py --each moe_test [--match REGEX]     one process per test case (a case the
                                                           emulator cannot run aborts only itself)
  scripts/kemu/kemu.py --build-only moe_test mhc_test
  scripts/kemu/kemu.py --cases scripts/kemu/ci_cases.txt   the curated set CTest runs (kemu_test)

The CPU libraries come from the CPU build (build/, the README's set-up command makes it); the
emulated objects, the rewritten source tree and the test binaries go to build-kemu/.
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_INCLUDE = "/usr/local/cuda/include"
TSAN = False  # --tsan: kernels and tests under ThreadSanitizer, barriers as its only sync
REPO = os.path.dirname(os.path.dirname(HERE))

# Sources the emulator cannot compile (CUTLASS kernels; cuBLAS and CUB users): the entry points
# tests reach come from stubs/ and abort with a message when called.
EXCLUDED = {
    "src/ops/cuda/attn_output/wo_a_cutlass.cu",
    "src/ops/cuda/gemm/fp8_gemm_prefill.cu",
    "src/ops/cuda/head/head.cu",
    "src/ops/cuda/sampling/sampling.cu",
}


# ---------------------------------------------------------------------------------------------
# Source rewriting: what g++ cannot take from a .cu file becomes calls into the emulator.


def split_top(s, sep):
    """Split on `sep` (',' or ':') at nesting depth 0, outside strings; '::' never splits."""
    out, depth, cur, i, instr = [], 0, [], 0, False
    while i < len(s):
        ch = s[i]
        if instr:
            cur.append(ch)
            if ch == "\\":
                cur.append(s[i + 1])
                i += 2
                continue
            if ch == '"':
                instr = False
            i += 1
            continue
        if ch == '"':
            instr = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            if sep == ":" and (s[i + 1:i + 2] == ":" or (i and s[i - 1] == ":")):
                cur.append(ch)
                i += 1
                continue
            out.append("".join(cur))
            cur = []
            i += 1
            continue
        cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def matching(s, i):
    """Index of the ')' that closes the '(' at s[i]."""
    depth, instr = 0, False
    while True:
        ch = s[i]
        if instr:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                instr = False
        elif ch == '"':
            instr = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def asm_text(tmpl):
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', tmpl)
    t = "".join(parts).replace("\\n", " ").replace("\\t", " ")
    return re.sub(r"\s+", " ", t).strip()


def operands(sec):
    sec = sec.strip()
    if not sec:
        return []
    ops = []
    for o in split_top(sec, ","):
        m = re.match(r'\s*"[^"]*"\s*\((.*)\)\s*$', o, re.S)
        if not m:
            raise ValueError(o)
        ops.append(m.group(1).strip())
    return ops


# Inline PTX written in kernel files (the shared PTX layer, ops/cuda/common/sm90, is replaced as a
# whole by override/): template -> C++ on the (outputs, inputs).
ASM = [
    (r"^prefetch\.", lambda o, i: "(void)0"),
    (r"^\{ \.reg \.b16 lo, hi; \.reg \.b32 ss; mov\.b32 \{lo, hi\}, %2; mov\.b32 ss, \{hi, hi\}; "
     r"fma\.rn\.bf16x2 %0, %1, ss, %3; \}$",
     lambda o, i: f"{o[0]} = ::kemu::ptx::fma_bf16x2_bcast({i[0]}, {i[1]}, 1, {i[2]})"),
    (r"^\{ \.reg \.b16 lo, hi; \.reg \.b32 ss; mov\.b32 \{lo, hi\}, %2; mov\.b32 ss, \{lo, lo\}; "
     r"fma\.rn\.bf16x2 %0, %1, ss, %3; \}$",
     lambda o, i: f"{o[0]} = ::kemu::ptx::fma_bf16x2_bcast({i[0]}, {i[1]}, 0, {i[2]})"),
    (r"^mma\.sync\.aligned\.m8n8k4\.row\.col\.f64\.f64\.f64\.f64",
     lambda o, i: f"::kemu::ptx::mma_f64_884({o[0]}, {o[1]}, {i[0]}, {i[1]})"),
    (r"^mma\.sync\.aligned\.m16n8k16\.row\.col\.f64\.f64\.f64\.f64",
     lambda o, i: "::kemu::ptx::mma_f64_16816(" + ", ".join(o + i) + ")"),
    (r"^cvt\.rn\.relu\.bf16x2\.f32 %0, %1, %2;?$",
     lambda o, i: f"{o[0]} = ::kemu::ptx::cvt_relu_bf16x2({i[0]}, {i[1]})"),
    (r"^prmt\.b32 %0, %1, 0, %2;?$", lambda o, i: f"{o[0]} = __byte_perm({i[0]}, 0u, {i[1]})"),
]


def rewrite_asm(src):
    out, i = [], 0
    for m in re.finditer(r"\basm\s*(?:volatile\s*)?\(", src):
        if m.start() < i:
            continue
        open_ = m.end() - 1
        close = matching(src, open_)
        secs = split_top(src[open_ + 1:close], ":")
        tmpl = asm_text(secs[0])
        code = None
        try:
            outs = operands(secs[1]) if len(secs) > 1 else []
            ins = operands(secs[2]) if len(secs) > 2 else []
        except (ValueError, IndexError):
            outs, ins, code = [], [], '::kemu::fail("unparsed asm")'
        for pat, fn in ASM:
            if code is None and re.search(pat, tmpl):
                code = fn(outs, ins)
        if code is None:
            text = tmpl.replace('"', "'").replace("\\", "/")[:120]
            code = f'::kemu::fail("inline PTX the emulator does not know: {text}")'
        out.append(src[i:m.start()])
        out.append("(" + code + ")")
        i = close + 1
    out.append(src[i:])
    return "".join(out)


SHARED = re.compile(
    r"(?<!extern )(?<!\w)__shared__\s+(?:__align__\s*\(\s*(\d+)\s*\)\s+)?"
    r"((?:typename\s+)?(?:const\s+)?[\w:]+(?:<[^;{}]*?>)?(?:\s+(?:int|long|char|short))?)\s+"
    r"(?:__align__\s*\(\s*(\d+)\s*\)\s+)?([^;=(){}]+);")


def rewrite_shared(src):
    """Static __shared__ declarations -> references into the CTA's emulated shared memory."""

    def rep(m):
        align = m.group(1) or m.group(3) or "0"
        decls = []
        for d in m.group(4).split(","):
            dm = re.match(r"(\w+)\s*((?:\[[^\]]*\])*)$", d.strip())
            if not dm:
                return m.group(0)
            name, dims = dm.group(1), dm.group(2)
            decls.append(f"typedef {m.group(2)} kemu_t_{name}{dims}; auto& {name} = "
                         f"::kemu::shared_var<kemu_t_{name}, {align}>("
                         "[] { static char k; return (const void*)&k; }());")
        return " ".join(decls)

    src = re.sub(
        r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([\w:]+)\s+"
        r"(?:__align__\s*\(\s*\d+\s*\)\s+)?(\w+)\s*\[\s*\]\s*;",
        r"\1* const \2 = reinterpret_cast<\1*>(::kemu::dyn_smem());", src)
    return SHARED.sub(rep, src)


def rewrite_cluster_dims(src):
    """__cluster_dims__ on a kernel: its body starts by telling the launch the cluster shape."""
    out, i = [], 0
    for m in re.finditer(r"__cluster_dims__\s*\(([^)]*)\)", src):
        brace = src.find("{", m.end())
        out.append(src[i:brace + 1])
        out.append(f" ::kemu::cluster_dims_hint({m.group(1)}); ")
        i = brace + 1
    out.append(src[i:])
    return "".join(out)


def rewrite_launches(src):
    """kernel<<<grid, block, smem, stream>>>(args) -> ::kemu::launcher(kernel, ...)(args)."""
    out, i = [], 0
    while True:
        p = src.find("<<<", i)
        if p < 0:
            out.append(src[i:])
            return "".join(out)
        j = p - 1
        while src[j].isspace():
            j -= 1
        end = j + 1
        if src[j] == ">":
            depth = 0
            while True:
                if src[j] == ">":
                    depth += 1
                elif src[j] == "<":
                    depth -= 1
                    if depth == 0:
                        j -= 1
                        break
                j -= 1
        while j >= 0 and (src[j].isalnum() or src[j] in "_:"):
            j -= 1
        start = j + 1
        q = src.find(">>>", p)
        out.append(src[i:start])
        out.append(f"::kemu::launcher({src[start:end]}, {src[p + 3:q]})")
        i = q + 3


def transform(text, name):
    # The kernels' bodies and device-only declarations are compiled (as host C++).
    text = text.replace("defined(__CUDACC__)", "1")
    text = text.replace("defined(__CUDA_ARCH__)", "1")
    text = text.replace("defined(__CUDA_ARCH_FEAT_SM90_ALL)", "1")
    text = re.sub(r"#\s*ifdef\s+__CUDACC__", "#if 1", text)
    text = re.sub(r"#\s*ifndef\s+__CUDACC__", "#if 0", text)
    if name.endswith((".cu", ".cuh", ".h")):
        text = rewrite_launches(rewrite_shared(rewrite_cluster_dims(rewrite_asm(text))))
    return text


def shadow(tree, out):
    """The tree's src/, include/ and tests/ rewritten; files rewritten only when they change."""
    root = os.path.join(out, "shadow")
    for top in ("src", "tests", "include"):
        for d, _, files in os.walk(os.path.join(tree, top)):
            for f in files:
                if not f.endswith((".h", ".cuh", ".cu", ".cpp", ".hpp", ".inc")):
                    continue
                src = os.path.join(d, f)
                dst = os.path.join(root, os.path.relpath(src, tree))
                text = transform(open(src, errors="replace").read(), f)
                if os.path.exists(dst) and open(dst, errors="replace").read() == text:
                    continue
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                with open(dst, "w") as fo:
                    fo.write(text)
    return root


# ---------------------------------------------------------------------------------------------
# Build


def flags(root, instrument=True):
    f = ["-std=c++20", "-O2", "-g0", "-w", "-pthread",
         "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing",
         "-include", os.path.join(HERE, "kemu.h"),
         "-I", os.path.join(HERE, "override")]
    if root:
        f += ["-I", os.path.join(root, "tests"), "-I", os.path.join(root, "src"),
              "-I", os.path.join(root, "include")]
    # DSV4_HAVE_CUTLASS: the wgmma kernels need only the PTX layer, which override/ replaces.
    f += ["-isystem", CUDA_INCLUDE, "-DGTEST_HAS_PTHREAD=1", "-DDSV4_HAVE_CUTLASS=1",
          f'-DDSV4_SOURCE_DIR="{REPO}"']
    if TSAN:
        f += ["-DKEMU_TSAN"] + (["-fsanitize=thread", "-O1", "-g"] if instrument else [])
    return f


def compile_unit(root, src, objdir):
    """One object; its name carries a hash of the preprocessed unit, so edits anywhere rebuild."""
    base = os.path.relpath(src, root).replace("/", "_") if src.startswith(root) else \
        os.path.basename(src)
    fl = flags(root, instrument=os.path.basename(src) != "rt.cpp")  # the runtime stays plain
    pp = subprocess.run(["g++"] + fl + ["-E", "-x", "c++", src], capture_output=True, text=True)
    if pp.returncode:
        sys.stderr.write(pp.stderr[:6000])
        raise SystemExit(f"kemu: cannot preprocess {src}")
    key = hashlib.sha1((pp.stdout + " ".join(fl)).encode()).hexdigest()[:16]
    obj = os.path.join(objdir, f"{base}.{key}.o")
    if os.path.exists(obj):
        return obj
    # The object from the preprocessed text already in hand (preprocessing once).
    r = subprocess.run(["g++"] + fl + ["-x", "c++-cpp-output", "-c", "-", "-o", obj],
                       input=pp.stdout, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(f"== {src}\n{r.stderr[:6000]}\n")
        raise SystemExit(f"kemu: cannot compile {src}")
    return obj


def ops_sources(root):
    out = []
    for d, _, files in os.walk(os.path.join(root, "src/ops/cuda")):
        for f in sorted(files):
            p = os.path.join(d, f)
            if f.endswith((".cu", ".cpp")) and os.path.relpath(p, root) not in EXCLUDED:
                out.append(p)
    glue = os.path.join(root, "src/backends/cuda/glue.cu")  # elementwise kernels some tests use
    if os.path.exists(glue):
        out.append(glue)
    stubs = os.path.join(HERE, "stubs")
    out += [os.path.join(stubs, f) for f in sorted(os.listdir(stubs)) if f.endswith(".cpp")]
    return sorted(out)


def build(tests, cpu_build, out, jobs):
    root = shadow(REPO, out)
    objdir = os.path.join(out, "obj")
    os.makedirs(objdir, exist_ok=True)
    units = ops_sources(root) + [os.path.join(HERE, "rt.cpp")]
    units += [os.path.join(root, "tests/support/gtest_main.cpp")]
    test_src = {t: os.path.join(root, "tests/cuda", t + ".cpp") for t in tests}
    for t, s in test_src.items():
        if not os.path.exists(s):
            raise SystemExit(f"kemu: no tests/cuda/{t}.cpp")
    with ThreadPoolExecutor(jobs) as ex:
        objs = list(ex.map(lambda s: compile_unit(root, s, objdir), units + list(test_src.values())))
    common = objs[:len(units)]
    libs = [f"{cpu_build}/src/{p}" for p in (
        "backends/cpu/libdsv4_backend_cpu.a", "model/libdsv4_model.a",
        "ops/cpu/libdsv4_ops_cpu.a", "kvcache/libdsv4_kvcache.a", "io/libdsv4_io.a",
        "core/libdsv4_core.a")]
    for lib in libs:
        if not os.path.exists(lib):
            raise SystemExit(f"kemu: {lib} missing: build the CPU tree first (README set-up)")
    bins = {}
    for t, obj in zip(tests, objs[len(units):]):
        exe = os.path.join(out, t + ("_tsan" if TSAN else ""))
        cmd = ["g++", "-pthread"] + (["-fsanitize=thread"] if TSAN else []) + ["-o", exe, obj] + \
            common + ["-Wl,--start-group"] + libs + ["-Wl,--end-group", "-lgtest"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            missing = sorted(set(re.findall(r"undefined reference to `([^']+)'", r.stderr)))
            sys.stderr.write(("\n".join(missing[:60]) if missing else r.stderr[:5000]) + "\n")
            raise SystemExit(f"kemu: cannot link {t}")
        bins[t] = exe
    return bins


def each(exe, match, timeout, extra):
    listing = subprocess.run([exe, "--gtest_list_tests"], capture_output=True, text=True).stdout
    cases, suite = [], ""
    for line in listing.splitlines():
        if not line.startswith(" "):
            suite = line.strip()
        else:
            cases.append(suite + line.split()[0])
    bad = 0
    for c in cases:
        if not re.search(match, c):
            continue
        t0 = time.time()
        try:
            r = subprocess.run([exe, f"--gtest_filter={c}"] + extra, capture_output=True,
                               text=True, timeout=timeout)
            rc, text = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            rc, text = 124, "timed out"
        why = ""
        if rc:
            bad += 1
            lines = [x for x in text.splitlines()
                     if "kemu:" in x or "Failure" in x or "SUMMARY: ThreadSanitizer" in x]
            tail = text.strip().splitlines()[-1:] or [""]
            why = " | ".join(lines[:2]) if lines else tail[0]
        print(f"{c:64s} {'ok' if rc == 0 else 'rc=%d' % rc:7s} {time.time() - t0:7.1f}s {why}",
              flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("tests", nargs="*", help="test names (tests/cuda/NAME.cpp)")
    ap.add_argument("--cases", help="a file of 'TEST REGEX' lines: run those cases, one process each")
    ap.add_argument("--cuda-include", default="/usr/local/cuda/include")
    ap.add_argument("--tsan", action="store_true",
                    help="ThreadSanitizer over the kernels: races between CUDA threads that no\n"
                         "barrier, collective or mbarrier orders (racecheck's class)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--each", action="store_true", help="one process per test case")
    ap.add_argument("--match", default=".", help="with --each: cases matching this regex")
    ap.add_argument("--timeout", type=int, default=900, help="with --each: seconds a case")
    ap.add_argument("--cpu-build", default=os.path.join(REPO, "build"))
    ap.add_argument("--out", default=os.path.join(REPO, "build-kemu"))
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args, extra = ap.parse_known_args()
    global CUDA_INCLUDE, TSAN
    CUDA_INCLUDE = args.cuda_include
    TSAN = args.tsan
    if not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda_runtime.h")):
        print(f"kemu: no CUDA headers at {CUDA_INCLUDE}: skipped")
        return 77
    cases = []
    if args.cases:
        for line in open(args.cases):
            line = line.split("#", 1)[0].strip()
            if line:
                name, regex = line.split(None, 1)
                cases.append((name, regex))
    tests = list(dict.fromkeys(args.tests + [c[0] for c in cases]))
    if not tests:
        ap.error("no tests named")
    bins = build(tests, args.cpu_build, args.out, args.j)
    if args.build_only:
        print("\n".join(bins.values()))
        return 0
    bad = 0
    if cases:
        for name, regex in cases:
            print(f"## {name}: {regex}", flush=True)
            bad += each(bins[name], regex, args.timeout, extra)
        print(f"kemu: {bad} case(s) failed" if bad else "kemu: every case passed")
        return 1 if bad else 0
    for t, exe in bins.items():
        if args.each:
            bad += each(exe, args.match, args.timeout, extra)
        else:
            bad += subprocess.run([exe] + extra).returncode != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
