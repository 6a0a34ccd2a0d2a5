#!/usr/bin/env python3
"""HF tokenizers (the Rust library, from PyPI) as the oracle for dsv4's tokenizer.

  encode   --tokenizer T --corpus C --out IDS     ids of every corpus document
  decode   --tokenizer T --ids IDS --out TEXTS [--skip-special]
                                                  text of every id sequence in IDS
  bench    --tokenizer T --corpus C [--repeat N]  single-thread encode/decode timing (JSON)
  expected --tokenizer T --corpus C --out JSON    the stored expectations of the C++ tests
  edge-cases --tokenizer T --out JSON             ids of hand-picked hard strings (stored too)

Corpus files (written by the C++ side, tests/tokenizer/corpus.h): per document, u32 name length,
name, u64 text length, text. Documents may hold invalid UTF-8; they are decoded with
errors="replace" (each maximal ill-formed subpart -> U+FFFD), the dsv4 tokenizer's policy.
Id files: per sequence, u64 count then count x u32. Text files: per text, u64 length then bytes.
All little-endian. Encoding never adds special tokens (add_special_tokens=False).
"""
import argparse
import hashlib
import json
import os
import platform
import struct
import sys
import time

import tokenizers
from tokenizers import Tokenizer


def read_corpus(path):
    docs = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        name = data[pos:pos + n].decode("utf-8")
        pos += n
        (m,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        docs.append((name, data[pos:pos + m]))
        pos += m
    return docs


def write_ids(path, seqs):
    with open(path, "wb") as f:
        for ids in seqs:
            f.write(struct.pack("<Q", len(ids)))
            f.write(struct.pack(f"<{len(ids)}I", *ids))


def read_ids(path):
    with open(path, "rb") as f:
        data = f.read()
    seqs, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        seqs.append(list(struct.unpack_from(f"<{n}I", data, pos)))
        pos += 4 * n
    return seqs


def encode_all(tok, docs):
    texts = [text.decode("utf-8", "replace") for _, text in docs]
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def ids_sha256(ids):
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def cmd_encode(a):
    tok = Tokenizer.from_file(a.tokenizer)
    write_ids(a.out, encode_all(tok, read_corpus(a.corpus)))


def cmd_decode(a):
    tok = Tokenizer.from_file(a.tokenizer)
    with open(a.out, "wb") as f:
        for ids in read_ids(a.ids):
            b = tok.decode(ids, skip_special_tokens=a.skip_special).encode("utf-8")
            f.write(struct.pack("<Q", len(b)))
            f.write(b)


def best_of(repeat, fn):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cmd_bench(a):
    # One thread (set before the thread pool starts): the comparison is single-thread speed;
    # encode() of one document does not use the pool anyway.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_file(a.tokenizer)
    docs = read_corpus(a.corpus)
    texts = [t.decode("utf-8", "replace") for _, t in docs]
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    encode_s = best_of(a.repeat, lambda: [tok.encode(t, add_special_tokens=False) for t in texts])
    decode_s = best_of(a.repeat, lambda: [tok.decode(i, skip_special_tokens=False) for i in ids])
    json.dump({"implementation": f"HF tokenizers {tokenizers.__version__} (Rust, via Python "
                                 f"{platform.python_version()}), encode() per document, "
                                 f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}",
               "bytes": nbytes, "tokens": sum(map(len, ids)), "documents": len(texts),
               "encode_seconds": encode_s, "decode_seconds": decode_s}, sys.stdout)
    print()


def cmd_expected(a):
    tok = Tokenizer.from_file(a.tokenizer)
    docs = read_corpus(a.corpus)
    header = {
        "note": "Expected ids of the tokenizer test corpus (tests/tokenizer/corpus.h), computed by "
                "HF tokenizers; regenerate with scripts/tokenizer/regenerate_expected.sh",
        "oracle": f"HF tokenizers {tokenizers.__version__}",
        "tokenizer_sha256": hashlib.sha256(open(a.tokenizer, "rb").read()).hexdigest(),
    }
    entries = []
    for (name, text), ids in zip(docs, encode_all(tok, docs)):
        entries.append({
            "name": name,
            "text_bytes": len(text),
            "text_sha256": hashlib.sha256(text).hexdigest(),
            "token_count": len(ids),
            "ids_sha256": ids_sha256(ids),
            "first_ids": ids[:48],
            "last_ids": ids[-16:],
        })
    write_json_lines(a.out, header, "documents", entries)


# Short strings at the edges of the pre-tokenizer, the added-token matcher and the invalid-UTF-8
# policy; "hex:" marks raw bytes (decoded with errors="replace" like the corpus).
EDGE_CASES = [
    "", " ", "  ", "\n", "\r\n", "\t\t", " \n ", "a  b", "a \n b", "   a", "a   ", "a \n\n",
    "\u3000\u3000x", "x\u00a0y", "x\u180ey", "x\u200by", "x\u2028y", "x\u0085y", "\x0b\x0c",
    "1", "12", "123", "1234", "1234567", "3.14159", "-42", "1,000,000", "x1y22z333w4444",
    "\u0663\u0664\u0665\u0666", "\uff11\uff12\uff13\uff14", "\u00b2\u00b3", "\u00bd", "\u216b",
    "\u2460\u2461\u2462", "Hello, world!", "...", "?!?!", "a.b.c", "'s", "don't", "I'M", "e.g.",
    "--flag=1", "#include <x>", "a->b", "x::y", "`code`", "(a)", "[a]", "{a}", '"q"',
    "\u00abq\u00bb", "\u00bfQu\u00e9?", "\u3002\uff0c\u3001", "\u4e2d\u6587", "\u4e2d\u6587abc",
    "abc\u4e2d\u6587", "\u4e2d\u6587123", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\u30ab\u30bf\u30ab\u30ca", "\uff76\uff80\uff76\uff85", "\ud55c\uad6d\uc5b4", "\u4e2d\u3002\u6587",
    "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f1ef\U0001f1f5", "1\ufe0f\u20e3", "\u2764\ufe0f", "\U0001fae8", "\U0001fae9",
    "a\U0001f600b", "hi \U0001fae8!", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>",
    "<think>", "</think>", "\uff5cDSML\uff5c", "<\uff5cDSML\uff5ctool_calls>", "<\uff5c/table>\uff5c",
    "<|place_holder_mm_span_0021|>", "<\uff5cplace\u2581holder\u2581no\u25810\uff5c>",
    "<think></think>", "<\uff5cUser\uff5c><\uff5cAssistant\uff5c>", "<\uff5cUser", "<\uff5cUser\uff5c",
    "\uff5cUser\uff5c>", "<|User|>", "<<\uff5cUser\uff5c>>", "a<think>b", "<dsml:x>", "</dsml:x>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c><\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
    "\u0645\u0631\u062d\u0628\u0627", "\u0928\u092e\u0938\u094d\u0924\u0947",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "e\u0301", "Z\u0335\u0354a\u0337l\u0336g\u0334o",
    "def f(x):\n    return x", "\tint x = 0;", "if (a && b) { c = d ?? e; }", "x<<=2", "0xDEADBEEF",
    "a_b_c", "camelCaseWord", "x\U00011f04y", "\U0002ebf0", "\U00031350", "\U000e0041",
    "\ue000", "\ufffe", "\x00", " " * 1000, "1" * 100, "\u4e2d" * 300, "ab" * 500,
    "hex:ff", "hex:80", "hex:c0af", "hex:e080af", "hex:eda080", "hex:f4908080", "hex:e4b8",
    "hex:f09f98", "hex:61ff62", "hex:e4b8ade6", "hex:c3", "hex:f09f98f09f9880",
]


def cmd_edge_cases(a):
    tok = Tokenizer.from_file(a.tokenizer)
    cases = []
    for s in EDGE_CASES:
        if s.startswith("hex:"):
            text = bytes.fromhex(s[4:]).decode("utf-8", "replace")
            entry = {"text_hex": s[4:]}
        else:
            text = s
            entry = {"text": s}
        entry["ids"] = tok.encode(text, add_special_tokens=False).ids
        cases.append(entry)
    write_json_lines(a.out, {"note": "ids computed by HF tokenizers; regenerate with "
                                     "scripts/tokenizer/regenerate_expected.sh",
                             "oracle": f"HF tokenizers {tokenizers.__version__}",
                             "tokenizer_sha256": hashlib.sha256(open(a.tokenizer, "rb").read()).hexdigest()},
                     "cases", cases)


def write_json_lines(path, header, key, entries):
    """`header` with `key` holding `entries`, one entry per line (readable diffs)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n")
        for k, v in header.items():
            f.write(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n")
        f.write(f"  {json.dumps(key)}: [\n")
        f.write(",\n".join("    " + json.dumps(e, ensure_ascii=False) for e in entries))
        f.write("\n  ]\n}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode")
    d = sub.add_parser("decode")
    b = sub.add_parser("bench")
    x = sub.add_parser("expected")
    g = sub.add_parser("edge-cases")
    for s in (e, d, b, x, g):
        s.add_argument("--tokenizer", required=True)
    for s in (e, b, x):
        s.add_argument("--corpus", required=True)
    for s in (e, d, x, g):
        s.add_argument("--out", required=True)
    d.add_argument("--ids", required=True)
    d.add_argument("--skip-special", action="store_true")
    b.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    commands = {"encode": cmd_encode, "decode": cmd_decode, "bench": cmd_bench,
                "expected": cmd_expected, "edge-cases": cmd_edge_cases}
    commands[a.cmd](a)


if __name__ == "__main__":
    main()
