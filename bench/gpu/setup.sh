#!/bin/bash
# On the GPU machine, from the project root: install the bundle made by bundle.sh and build the
# random-weight models of the real shapes (bench/random_models.py).
#   source bench/gpu/setup.sh BUNDLE [MODELS_DIR]     (MODELS_DIR default /root)
# Afterwards: PYTHONPATH has the project and the wheels; models in MODELS_DIR/m135r and m1p7r.
# CHECK_REHEARSE=1 (check.sh's CPU rehearsal): nothing installed (python3 is the project's venv),
# the same folders built tiny on the CPU from the bundle's tok/.
bundle=${1:?bundle folder}
models=${2:-/root}
if [ -n "${CHECK_REHEARSE:-}" ]; then
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  python3 bench/random_models.py --source "$bundle/tok" --out "$models" --device cpu --tiny
  return
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/wheels/*.whl || return 1
export PYTHONPATH=$PWD:/tmp/site GUARDSTREAM_CACHE=${GUARDSTREAM_CACHE:-/root/gscache} PYTHONUNBUFFERED=1
python3 bench/random_models.py --source "$bundle/tok" --out "$models" --device cuda
