#!/bin/bash
# One GPU check for the engine (issue 35), in under 9 minutes on one H100 or H200 from a fresh
# machine, set-up included. From the project root:
#   OUT=/some/dir bash bench/gpu/check.sh BUNDLE [MODELS_DIR]
# BUNDLE: the folder bench/gpu/bundle.sh made (wheels/ and tok/); MODELS_DIR (default /root): where
# setup.sh builds the random-weight models (m135r: smollm2-135m's shape, m1p7r: SmolLM2-1.7B's).
#
# Steps, each under its own `timeout` so that one that hangs costs only its share:
#   1. set-up (setup.sh; skipped when the models exist: a warm machine);
#   2. bench/engine_host.py --device cuda (the host's share of a step, null model);
#   3. bench/engine.py, 135M shape, 1/64/256 streams, next to its anchors (generate, a graph-
#      replayed StaticCache step, transformers serve --continuous-batching --cb-use-cuda-graph);
#      again with --compile when bench/engine.py has that flag;
#   4. bench/engine.py, 1.7B shape, 64 streams (generate and step anchors), and with --compile;
#   5. the CUDA engine and migration tests, file by file (-rf --tb=short: a cut keeps every
#      finished file's summary) in three parallel lanes, until the overall deadline
#      (CHECK_SECONDS after the start, default 520).
# Everything lands in $OUT: one log per step and summary.txt (the lines that matter, read by a
# person or a script). Expected on an H100/H200: set-up ~60 s, host ~40 s, 135M ~150 s, 1.7B ~50 s,
# tests ~100 s in lanes (about 220 s one file after another, measured 2026-11-26).
set -u
bundle=${1:?usage: OUT=DIR bash bench/gpu/check.sh BUNDLE [MODELS_DIR]}
models=${2:-/root}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
summary=$out/summary.txt
: > "$summary"
t0=$(date +%s)
deadline=$((t0 + ${CHECK_SECONDS:-540}))
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((deadline - $(date +%s))); }

# run NAME LIMIT_S COMMAND...: the command's output to $out/NAME.log, its status to the summary;
# the limit is cut to what is left before the deadline (a step with < 10 s left is skipped).
run() {
  local name=$1 limit=$2
  shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 10 ]; then
    say "--- $name: skipped, no time left ($(elapsed) s)"
    return 1
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  # an anchor server outlives a cut bench (its own session) and holds the GPU's memory
  pkill -9 -f "transformers serve" 2>/dev/null
  local how="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && how="cut at ${limit} s"
  say "--- $name: $how, $(elapsed) s"
  return $rc
}

say "=== gpu check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
say "cpus $(nproc)"

# 1. set-up: the wheels under /tmp/site, PYTHONPATH, the random-weight models
if [ -f "$models/m135r/config.json" ] && [ -f "$models/m1p7r/config.json" ] && [ -d /tmp/site ]; then
  export PYTHONPATH=$PWD:/tmp/site GUARDSTREAM_CACHE=${GUARDSTREAM_CACHE:-/root/gscache}
  say "--- setup: models present, skipped"
else
  # setup.sh is sourced for its exports; its own commands are bounded by this step's budget
  # through `timeout` on a subshell that writes the environment it ends with
  timeout -k 5 150 bash -c "source bench/gpu/setup.sh '$bundle' '$models' && env" \
    > "$out/setup.log" 2>&1
  rc=$?
  say "--- setup: rc=$rc, $(elapsed) s"
  export PYTHONPATH=$PWD:/tmp/site GUARDSTREAM_CACHE=${GUARDSTREAM_CACHE:-/root/gscache}
  if [ $rc -ne 0 ]; then
    tail -20 "$out/setup.log" | tee -a "$summary"
    exit 1
  fi
fi
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$summary"

if [ -n "${CHECK_TESTS:-}" ]; then  # a rerun of some test files only: skip the benchmarks
  say "--- benchmarks: skipped (CHECK_TESTS)"
else
# 2. the host's share of a step (null model on the GPU)
run engine_host 150 python3 bench/engine_host.py --device cuda --rows 1,64,256 --tokens 128
grep -E "^(inproc|http) |^host_us_per_row|^cpu_us_per_row|^client_cpu_us_per_row|^overlap_off" "$out/engine_host.log" >> "$summary"

# 3. and 4. the engine next to its anchors
compile=""
grep -q -- '"--compile"' bench/engine.py && compile=yes
side_by_side() {  # the lines a reader compares: aggregate, TTFT, step vs graph replay
  grep -E "streams: +[0-9.]+ tok/s aggregate|side by side|engine +[0-9.]+ \|" "$out/$1.log" >> "$summary"
}
run e135 210 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 128 \
  --concurrency 1,64,256 --skip-micro --rounds 1 --json "$out/e135.json"
side_by_side e135
run e1p7 80 python3 bench/engine.py --device cuda --model "$models/m1p7r" --tokens 128 \
  --concurrency 64 --skip-micro --rounds 1 --anchors generate,step --json "$out/e1p7.json"
side_by_side e1p7
if [ -n "$compile" ]; then
  run e135_compile 70 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 128 \
    --concurrency 1,64,256 --skip-micro --rounds 1 --anchors step --compile \
    --json "$out/e135_compile.json"
  side_by_side e135_compile
  run e1p7_compile 40 python3 bench/engine.py --device cuda --model "$models/m1p7r" --tokens 128 \
    --concurrency 64 --skip-micro --rounds 1 --anchors none --compile --json "$out/e1p7_compile.json"
  side_by_side e1p7_compile
else
  say "--- compile: bench/engine.py has no --compile yet, skipped"
fi
fi  # CHECK_TESTS

# 5. the CUDA tests, file by file ("file:limit_s"), in three lanes at once (16 cores; after the
# benchmarks, which they would disturb), each lane until the deadline. test_migration_engine
# restarts killed replicas, each a fresh CUDA start: its lane has little else.
export GUARDSTREAM_TEST_DEVICE=cuda
lane1=(tests/test_engine_static_decode.py:60 tests/test_engine_device_sampling.py:60
  tests/test_engine_batching.py:90 tests/test_engine_batch_invariant.py:90
  tests/test_engine_sampling.py:60)
lane2=(tests/test_engine_resume.py:90 tests/test_engine_chunked_prefill.py:60
  tests/test_engine_units.py:60 tests/test_engine_api.py:90
  tests/test_engine_chat_limits_auth.py:60 tests/test_engine_smollm2.py:30)
lane3=(tests/test_migration_engine.py:180 tests/test_engine_subprocess.py:90
  tests/test_migration_batch_invariant.py:90 tests/test_migration.py:90)
if [ -n "${CHECK_TESTS:-}" ]; then  # CHECK_TESTS="file:limit ...", dealt round-robin to the lanes
  lane1=() lane2=() lane3=()
  i=0
  for entry in $CHECK_TESTS; do
    case $((i % 3)) in 0) lane1+=("$entry") ;; 1) lane2+=("$entry") ;; 2) lane3+=("$entry") ;; esac
    i=$((i + 1))
  done
fi
files=("${lane1[@]}" "${lane2[@]}" "${lane3[@]}")
test_lane() {
  local entry file name
  for entry in "$@"; do
    file=${entry%%:*}
    [ -f "$file" ] || continue
    name=tests_$(basename "$file" .py)
    # no pytest-timeout override: a hanging test is cut by its file's limit (a cut file keeps
    # nothing of -rf, so hangs show as "cut at"; the log has the progress dots)
    run "$name" "${entry##*:}" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$file"
  done
}
test_lane "${lane1[@]}" &
test_lane "${lane2[@]}" &
test_lane "${lane3[@]}" &
wait
for entry in "${files[@]}"; do  # each file's summary line ("N passed, M failed") and failures
  name=tests_$(basename "${entry%%:*}" .py)
  [ -f "$out/$name.log" ] || continue
  say "--- $name:"
  grep -E "^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|error)" "$out/$name.log" | tail -25 >> "$summary"
done
# every test file of the engine and migration suites, so none is forgotten by the list above
for file in tests/test_engine_*.py tests/test_migration*.py; do
  case " ${files[*]} " in
    *" $file:"*) ;;
    *) say "--- $file: not in check.sh's list, not run" ;;
  esac
done
say "=== done in $(elapsed) s"
