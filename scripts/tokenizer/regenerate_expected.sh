#!/usr/bin/env bash
# Regenerates the stored tokenizer expectations in tests/tokenizer/data/ from HF tokenizers (the
# oracle): the per-document id hashes of the test corpus and the edge-case ids. Needs
# `python3 -m pip install tokenizers` and a build tree with tokenizer_corpus:
#   scripts/tokenizer/regenerate_expected.sh [BUILD_DIR (default build)]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD="${1:-build}"
TOK="${DSV4_TOKENIZER_DIR:-../shared/tokenizer/deepseek-v4}/tokenizer.json"
cmake --build "$BUILD" --target tokenizer_corpus
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$BUILD/tests/tokenizer/tokenizer_corpus" --tokenizer "$TOK" --out "$TMP/corpus.bin"
python3 scripts/tokenizer/hf_oracle.py expected --tokenizer "$TOK" --corpus "$TMP/corpus.bin" \
  --out tests/tokenizer/data/corpus_expected.json
python3 scripts/tokenizer/hf_oracle.py edge-cases --tokenizer "$TOK" \
  --out tests/tokenizer/data/edge_cases.json
echo "updated tests/tokenizer/data/corpus_expected.json and edge_cases.json"
