#!/bin/bash
# One GPU check for the engine (issue 35), from the project root, in two calls of under 9 minutes
# each on one H100 or H200 (set-up included; the second call on the same warm machine skips it):
#   OUT=/some/dir CHECK_PART=bench bash bench/gpu/check.sh BUNDLE [MODELS_DIR]
#   OUT=/some/dir CHECK_PART=tests bash bench/gpu/check.sh BUNDLE [MODELS_DIR]
#   OUT=/some/dir CHECK_PART=binv bash bench/gpu/check.sh BUNDLE [MODELS_DIR]   (issue 36, ~7 min)
# BUNDLE: the folder bench/gpu/bundle.sh made (wheels/ and tok/); MODELS_DIR (default /root): where
# setup.sh builds the random-weight models (m135r: smollm2-135m's shape, m1p7r: SmolLM2-1.7B's).
# CHECK_PART=all runs both parts in one call: ~15 minutes, more than one device call may run.
# CHECK_STEPS="e135 ttft ..." runs the named steps only, in the order named (2026-11-28: steps
# ran in this file's order whatever the order asked, so `judge` came after a 170 s `e135_compile`
# cut and was skipped); CHECK_TESTS="file:limit ..." some test files only (the tests step).
#
# Steps, each under its own `timeout` so that one that hangs costs only its share:
#   0. set-up (setup.sh; skipped when the models exist: a warm machine);
#   part bench:
#   e135     bench/engine.py, 135M shape, 1/64/256 streams, next to its anchors (generate, a graph-
#            replayed StaticCache step, transformers serve --continuous-batching --cb-use-cuda-graph);
#   e135_oneproc  the engine alone at 64 and 256 streams as one process (--no-api-process): the
#            API-process split's effect, same machine (only when named in CHECK_STEPS or part all);
#   e1p7     bench/engine.py, 1.7B shape, 64 streams (generate and step anchors);
#   ttft     TTFT of a fresh engine's first 64 and 256 clients (bench/engine.py --cold, greedy),
#            with warm prefill (the CUDA default) and without (--no-prefill-buckets
#            --no-warm-prefill);
#   e135_compile  the 135M shape with --compile, 1 and 64 streams, next to the graph-replayed step;
#   part tests:
#   engine_host   bench/engine_host.py --device cuda (the host's share of a step, null model);
#   tests    the CUDA engine and migration tests, file by file (-rf --tb=short: a cut keeps every
#            finished file's summary) in four parallel lanes, until the part's deadline
#            (CHECK_SECONDS after the start, default 520);
#   judge    bench/judge.py --device cuda (issue 37): incremental judge sessions at 1 and 16 streams
#            against re-judging prefixes, 135M shape (random weights: the cost, not the verdicts),
#            the static judge pass from CUDA graphs next to the packed eager one (1 stream);
#   e1p7_compile  the 1.7B shape with --compile, 64 streams (last: what is left of the deadline).
#   part binv (--batch-invariant on the Triton kernels, generation/invariant_kernels.py):
#   binv_tests  on CUDA, in two lanes: tests/test_invariant_kernels.py (the kernels compiled),
#            tests/test_engine_batch_invariant.py, tests/test_migration_batch_invariant.py (two
#            managed bf16 replicas, SIGKILL mid-stream), with smollm2-135m's shape from m135r
#            (random weights, served as smollm2-135m from a private GUARDSTREAM_CACHE: the bundle
#            has no smollm2 weights; greedy on random weights repeats a token, seeded does not);
#   binv     bench/engine.py --batch-invariant, 135M shape, bf16, 64 tokens, 1/64/256 streams:
#            the default engine, then the batch-invariant one, each level's throughput as a
#            ratio of the default's in the same run (the mode's cost; target >= 0.75x).
# The compile steps run only when bench/engine.py has --compile. Everything lands in $OUT: one log
# per step and summary.txt (the lines that matter, read by a person or a script). Measured on an
# H200 (2026-11-27, before the split): set-up 29 s, engine_host ~120 s, e135 ~200 s, e1p7 ~60 s,
# tests ~150 s in lanes. Not measured yet: ttft (~60-90 s expected: two engine starts) and the
# compile steps (Inductor compiles 1 graph per model at start, then the graphs are captured;
# the engine logs each compile and the capture's progress, echoed live as "engine log:" lines).
set -u
bundle=${1:?usage: OUT=DIR bash bench/gpu/check.sh BUNDLE [MODELS_DIR]}
models=${2:-/root}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
summary=$out/summary.txt
: > "$summary"
t0=$(date +%s)
# CHECK_REHEARSE=1: this script rehearsed on a CPU (bench/gpu/rehearse.sh, `make gpu-rehearsal`)
# before a lent session. Every step runs its own command line, which run() swaps to the CPU and
# cuts to rehearsal sizes by appending options (argparse keeps an option's last value); the
# test lanes only collect (no GUARDSTREAM_TEST_DEVICE); setup.sh builds tiny random models of
# the same folders. Each grep that fills the summary must find each of its alternatives in its
# step's log, every step must end rc=0: otherwise a "REHEARSAL: step X: ..." line, and exit 1.
rehearse=${CHECK_REHEARSE:-}
rehearse_engine=${CHECK_REHEARSE_ENGINE:---tokens 8 --concurrency 1,2}
rehearse_engine_host=${CHECK_REHEARSE_ENGINE_HOST:---rows 1,2 --tokens 8 --ttft 2}
rehearse_judge=${CHECK_REHEARSE_JUDGE:---streams 1,2 --tokens 120}
rehearse_optional=(  # alternatives a CPU rehearsal cannot print
  "^(FAILED|ERROR|SKIPPED) "      # pytest: only failures and skips
  "[0-9]+ (passed|failed|skipped|error)"  # pytest's last line: the rehearsal only collects (rc says)
  "^per pass:"                    # bench/judge.py: on CUDA only
  "^warm-up:"                     # bench/judge.py: with CUDA graphs only (the static judge pass)
  "^judge passes:"                # bench/judge.py: the two passes side by side, on CUDA only
  "engine log: .*(warmed|captured)"  # the engine warms prefill and captures graphs on CUDA only
  "serve failed: "                # bench/engine.py's serve anchor, only when it fails (which
                                  # rehearse_outcome reports)
)
if [ -n "$rehearse" ]; then
  # the project's venv, its GUARDSTREAM_CACHE (not /root's), nothing from /tmp/site
  py=${CHECK_PYTHON:-$PWD/.venv/bin/python}
  [ -x "$py" ] || { echo "CHECK_PYTHON: no python at $py" >&2; exit 2; }
  export PATH=$(dirname "$py"):$PATH GUARDSTREAM_CACHE=${GUARDSTREAM_CACHE:-$HOME/.cache/guardstream}
  case $models in /root | /root/*) echo "a rehearsal builds no models under /root" >&2; exit 2 ;; esac
fi
rehearsal_error() {  # STEP WHAT: a line the rehearsal fails on
  echo "REHEARSAL: step $1: $2" | tee -a "$summary" >&2
}
deadline=$((t0 + ${CHECK_SECONDS:-520}))
part=${CHECK_PART:?CHECK_PART=bench, tests or binv (each under 9 minutes), or all (~22 minutes)}
case $part in
  bench) steps="e135 e1p7 ttft e135_compile" ;;
  tests) steps="engine_host tests judge e1p7_compile" ;;
  binv) steps="binv_tests binv" ;;
  all) steps="e135 e135_oneproc e1p7 ttft e135_compile engine_host tests judge e1p7_compile binv_tests binv"
    deadline=$((t0 + ${CHECK_SECONDS:-1400})) ;;
  *) echo "CHECK_PART must be bench, tests, binv or all, not $part" >&2; exit 2 ;;
esac
[ -n "$rehearse" ] && deadline=$((t0 + ${CHECK_SECONDS:-3600}))  # a busy CPU: no GPU deadline
[ -n "${CHECK_STEPS:-}" ] && steps=$CHECK_STEPS
[ -n "${CHECK_TESTS:-}" ] && [ -z "${CHECK_STEPS:-}" ] && steps=tests
known=" e135 e135_oneproc e1p7 ttft e135_compile engine_host tests judge e1p7_compile binv_tests binv "
for step in $steps; do  # a mistyped step would cost a lent machine's call: refuse it here
  case $known in *" $step "*) ;; *) echo "CHECK_STEPS: no step $step (one of:$known)" >&2; exit 2 ;; esac
done
wants() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
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
  [ -n "$rehearse" ] && { rehearse_command "$name" "$@"; set -- "${rehearsed[@]}"; limit=$((limit * 3 > 180 ? limit * 3 : 180)); }
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  # cut_signal=INT (the test lanes): pytest stops as on Ctrl-C and still prints the failures so
  # far and its -r summary, where a TERM loses them (2026-11-28: a cut file showed only "F")
  timeout -s "${cut_signal:-TERM}" -k "${cut_grace:-5}" "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  # an anchor server outlives a cut bench (its own session) and holds the GPU's memory (not in a
  # rehearsal: a shared CPU machine's other servers are not ours to kill)
  [ -z "$rehearse" ] && pkill -9 -f "transformers serve" 2>/dev/null
  local how="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && how="cut at ${limit} s"
  say "--- $name: $how, $(elapsed) s"
  [ -n "$rehearse" ] && rehearse_outcome "$name" "$rc" "$@"
  return $rc
}

# rehearsal: STEP COMMAND... -> rehearsed=(the command on the CPU at rehearsal sizes)
rehearse_command() {
  local name=$1 word
  shift
  rehearsed=(env -u GUARDSTREAM_TEST_DEVICE)
  for word in "$@"; do
    [ "$word" = GUARDSTREAM_TEST_DEVICE=cuda ] || rehearsed+=("$word")
  done
  case " $* " in
    *" bench/engine.py "*)  # with CUDA's default anchors (serve included) unless it names some
      rehearsed+=(--device cpu $rehearse_engine)
      case " $* " in *" --anchors "*) ;; *) rehearsed+=(--anchors generate,step,serve) ;; esac ;;
    *" bench/engine_host.py "*) rehearsed+=(--device cpu $rehearse_engine_host) ;;
    *" bench/judge.py "*) rehearsed+=(--device cpu $rehearse_judge) ;;
    *" -m pytest "*) rehearsed+=(--collect-only) ;;
    *) rehearsal_error "$name" "no rehearsal sizes for: $*" ;;
  esac
}
# rehearsal: STEP RC COMMAND...: the step ended rc=0, wrote its --json, printed no failure
rehearse_outcome() {
  local name=$1 rc=$2 prev="" word
  shift 2
  [ "$rc" -eq 0 ] || rehearsal_error "$name" "rc=$rc (see $name.log)"
  for word in "$@"; do
    [ "$prev" = --json ] && [ ! -s "$word" ] && rehearsal_error "$name" "no --json file $word"
    prev=$word
  done
  command grep -m 3 -E "failed: |^Traceback |NOT compiled" "$out/$name.log" |
    while IFS= read -r word; do rehearsal_error "$name" "failure in its log: $word"; done
}
# rehearsal: an ERE's top-level alternatives, one a line (a|b(c|d) -> a, b(c|d))
rehearse_alternatives() {
  local pattern=$1 depth=0 i c alt=""
  for ((i = 0; i < ${#pattern}; i++)); do
    c=${pattern:i:1}
    case $c in
      \\) alt+=${pattern:i:2}; i=$((i + 1)); continue ;;
      "(" | "[") depth=$((depth + 1)) ;;
      ")" | "]") depth=$((depth - 1)) ;;
      "|") [ $depth -eq 0 ] && { printf '%s\n' "$alt"; alt=""; continue; } ;;
    esac
    alt+=$c
  done
  printf '%s\n' "$alt"
}
if [ -n "$rehearse" ]; then
  # Every `grep [OPTIONS] PATTERN $out/STEP.log` below (the summary's lines) is checked: each of
  # PATTERN's alternatives must match a line of that log, unless rehearse_optional names it.
  grep() {
    command grep "$@"
    local rc=$? file=${!#} n=$(($# - 1)) alt known
    case $file in "$out"/*.log) ;; *) return $rc ;; esac
    local pattern=${!n}
    while IFS= read -r alt; do
      for known in "${rehearse_optional[@]}"; do [ "$alt" = "$known" ] && continue 2; done
      command grep -qE -- "$alt" "$file" 2>/dev/null ||
        rehearsal_error "$(basename "$file" .log)" "no line matching '$alt'"
    done < <(rehearse_alternatives "$pattern")
    return $rc
  }
fi

say "=== gpu check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), part $part: $steps"
if [ -n "$rehearse" ]; then
  say "REHEARSAL on the CPU: tiny models in $models, every step at rehearsal sizes, tests collected only"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
fi
say "cpus $(nproc)"

# 1. set-up: the wheels under /tmp/site, PYTHONPATH, the random-weight models
if [ -f "$models/m135r/config.json" ] && [ -f "$models/m1p7r/config.json" ] && { [ -d /tmp/site ] || [ -n "$rehearse" ]; }; then
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
if [ -n "$rehearse" ]; then  # the venv has the wheels; the guard hides what the GPU lacks
  export PYTHONPATH=$PWD
  [ -f "$bundle/wheels.txt" ] && export PYTHONPATH=$PWD/bench/gpu/rehearse_site:$PWD \
    GUARDSTREAM_REHEARSE_BUNDLE=$bundle
fi
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$summary"

compile=""
grep -q -- '"--compile"' bench/engine.py && compile=yes
side_by_side() {  # the lines a reader compares: aggregate, TTFT, step vs graph replay (and why
  # an anchor server is missing from them: bench/engine.py goes on without it, rc=0)
  # `worker` lines: a decode step's time in the engine's worker thread by part, per level (the
  # host-bound share on a GPU: device_wait near 0) and the loop's delivery (/health `worker`)
  grep -E "streams: +[0-9.]+ tok/s aggregate|^ttft |^worker |side by side|engine +[0-9.]+ \||serve failed: " "$out/$1.log" >> "$summary"
}

# part bench: the engine next to its anchors, a fresh engine's TTFT, the compiled step
step_e135() {
  # --rounds 2: the decodings alternate (greedy first in round 1, sampling first in round 2), so
  # the side-by-side medians pay a fresh level's first-use costs once each (2026-11-28, one
  # round: greedy ran every level first and was 1.126x slower at 256); ~10 s more than one round
  run e135 230 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 128 \
    --concurrency 1,64,256 --skip-micro --rounds 2 --json "$out/e135.json"
  side_by_side e135
}
step_e135_oneproc() {  # the replica as one process (before the API-process split), same shape
  run e135_oneproc 70 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 128 \
    --concurrency 64,256 --skip-micro --rounds 1 --anchors none --extra-args="--no-api-process" \
    --json "$out/e135_oneproc.json"
  say "one process (--no-api-process):"
  grep -E "streams: +[0-9.]+ tok/s aggregate|^worker " "$out/e135_oneproc.log" >> "$summary"
}
step_e1p7() {
  # ~60 s on an H100 (2026-11-25) before the engine captured its prefill graphs at start: 120 s
  run e1p7 120 python3 bench/engine.py --device cuda --model "$models/m1p7r" --tokens 128 \
    --concurrency 64 --skip-micro --rounds 2 --anchors generate,step --json "$out/e1p7.json"
  side_by_side e1p7
}
step_ttft() {  # the first clients of a fresh engine: warm prefill on (default), then off
  run ttft_warm 60 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 16 \
    --concurrency 64,256 --decoding greedy --skip-micro --rounds 1 --anchors none --cold
  say "ttft, warm prefill (default):"
  grep -E "^ttft " "$out/ttft_warm.log" >> "$summary"
  run ttft_cold 60 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 16 \
    --concurrency 64,256 --decoding greedy --skip-micro --rounds 1 --anchors none --cold \
    --extra-args="--no-prefill-buckets --no-warm-prefill"
  say "ttft, no prefill buckets, no warm-up:"
  grep -E "^ttft " "$out/ttft_cold.log" >> "$summary"
  grep -hE "engine log: .*(warmed|captured)" "$out/ttft_warm.log" >> "$summary"
}
step_e135_compile() {
  # 2026-11-28 (H200): not started within 170 s (two compiles of the 30-layer step, each traced
  # twice); now one compile traced once (~100 s on a 2-core CPU), its progress in the log: 240 s
  if [ -n "$compile" ]; then
    run e135_compile 240 python3 bench/engine.py --device cuda --model "$models/m135r" \
      --tokens 128 --concurrency 1,64 --skip-micro --rounds 1 --anchors step --compile \
      --json "$out/e135_compile.json"
    side_by_side e135_compile
    # how far start-up got (a cut step too): compiles, warm-up and capture progress
    grep -hE "engine log: .*(captured|compil|capture:|warm-up)" "$out/e135_compile.log" >> "$summary"
  else
    say "--- e135_compile: bench/engine.py has no --compile, skipped"
  fi
}

# part tests: the host's share of a step, the 1.7B shape compiled, the CUDA tests
step_engine_host() {
  # three paths: in process, one-process HTTP, and the API process + engine core (the default)
  run engine_host 200 python3 bench/engine_host.py --device cuda --rows 1,64,256 --tokens 128
  grep -E "^(inproc|http|http-api) |^ttft |^host_us_per_row|^ttft_ms_|^client_cpu_us_per_row|^load average" "$out/engine_host.log" >> "$summary"
}
# the CUDA tests, file by file ("file:limit_s"), in four lanes at once (16 cores; after the
# benchmarks, which they would disturb), each lane until the deadline. Measured on an H200
# (2026-11-28, at f2f0c75, three lanes then): every file's time including pytest's start (~10 s)
# and its engines' CUDA starts (a tiny-random engine now captures 63 decode and 57 prefill graphs
# at start, ~15 s, so the files that start engine processes got slower: test_engine_subprocess
# 42 s -> cut at 90 s, test_engine_sampling 44 s -> cut at 60 s); three lanes took 400 s and cut
# test_engine_static_prefill, so a fourth lane, each ~250 s of files: lane 1 the files that
# start and kill replicas (test_migration_engine ~125 s, test_engine_subprocess: ~7 engine
# starts, 5 of its 11 tests in 90 s), lane 2 the step and sampler files,
# lane 3 the API files, lane 4 the judge, tool-call, IPC and static-prefill files (the judge
# files crashed on CUDA until float64 took the torch kernels: their times are estimates).
step_tests() {
export GUARDSTREAM_TEST_DEVICE=cuda
lane1=(tests/test_migration_engine.py:180 tests/test_engine_subprocess.py:180)
lane2=(tests/test_engine_static_decode.py:60 tests/test_engine_device_sampling.py:60
  tests/test_engine_batching.py:90 tests/test_engine_batch_invariant.py:90
  tests/test_invariant_kernels.py:60 tests/test_engine_sampling.py:100
  tests/test_engine_warm_prefill.py:60 tests/test_migration.py:60)
lane3=(tests/test_engine_resume.py:90 tests/test_engine_chunked_prefill.py:60
  tests/test_engine_units.py:60 tests/test_engine_api.py:100
  tests/test_engine_chat_limits_auth.py:70 tests/test_engine_smollm2.py:30
  tests/test_engine_overlap.py:60 tests/test_migration_replay.py:60
  tests/test_migration_batch_invariant.py:90)
lane4=(tests/test_engine_compile.py:90 tests/test_judge_sessions.py:120
  tests/test_engine_judge.py:90 tests/test_engine_tool_calls.py:60 tests/test_engine_ipc.py:60
  tests/test_engine_static_prefill.py:90)
if [ -n "${CHECK_TESTS:-}" ]; then  # CHECK_TESTS="file:limit ...", dealt round-robin to the lanes
  lane1=() lane2=() lane3=() lane4=()
  i=0
  for entry in $CHECK_TESTS; do
    case $((i % 4)) in
      0) lane1+=("$entry") ;; 1) lane2+=("$entry") ;; 2) lane3+=("$entry") ;; 3) lane4+=("$entry") ;;
    esac
    i=$((i + 1))
  done
fi
files=("${lane1[@]}" "${lane2[@]}" "${lane3[@]}" "${lane4[@]}")
test_lane() {
  local entry file name
  for entry in "$@"; do
    file=${entry%%:*}
    [ -f "$file" ] || { [ -n "$rehearse" ] && rehearsal_error tests "no file $file"; continue; }
    name=tests_$(basename "$file" .py)
    # no pytest-timeout override: a hanging test is cut by its file's limit, with SIGINT, so a
    # cut file keeps its failures so far, its -r summary and where the test hung
    cut_signal=INT cut_grace=20 run "$name" "${entry##*:}" \
      python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$file"
  done
}
test_lane "${lane1[@]}" &
test_lane "${lane2[@]}" &
test_lane "${lane3[@]}" &
test_lane "${lane4[@]}" &
wait
for entry in "${files[@]}"; do  # each file's summary line ("N passed, M failed"; "N skipped" alone:
  # a file whose tests all skip, which the 2026-11-27 summary lost) and failures
  name=tests_$(basename "${entry%%:*}" .py)
  [ -f "$out/$name.log" ] || continue
  say "--- $name:"
  grep -E "^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|skipped|error)" "$out/$name.log" | tail -25 >> "$summary"
done
# every test file of the engine and migration suites, so none is forgotten by the list above
for file in tests/test_engine_*.py tests/test_migration*.py; do
  case " ${files[*]} " in
    *" $file:"*) ;;
    *) say "--- $file: not in check.sh's list, not run"
      [ -n "$rehearse" ] && rehearsal_error tests "$file is in no lane" ;;
  esac
done
}  # tests

# issue 37: judge sessions on the GPU (135M shape, random weights: the cost, not the verdicts),
# 1 and 16 concurrent streams of incremental appends against re-judging prefixes; per pass:
# the judge pass, the same with cuDNN attention allowed, and a plain forward of as many tokens;
# then (--profile) one 1-stream and one 16-stream pass under torch.profiler: wall, GFLOP/s,
# kernel launches, host syncs, the device's busy time and the top 10 ops by self CUDA time
# (the "prof" lines, ~13 per level). ~110 s on an H200 when a pass cost ~60 ms, before the
# profile (~15 s more: 70 passes to build each level's prefixes, the profiler's start).
# The judge pass is the CUDA default, static (generation/judge_graphs.py: graphs captured per
# key at first use; the `warm-up:` lines give the captures), each line says which pass ran and
# its graphs captured/replayed (`pass=... graphs=C/R`); the packed pass's incremental 1-stream
# line follows on an engine of its own, and `judge passes:` sets the two side by side. The
# bench's engines have no static decode step (no decode graphs to capture at their start).
step_judge() {
  run judge 170 python3 bench/judge.py --device cuda --dtype bfloat16 --model "$models/m135r" \
    --streams 1,16 --profile --json "$out/judge.json"
  grep -E "^ *(incremental|rejudging|re-judging)|streams: .*the judged|^per pass:|^prof |^warm-up:|^judge passes:|^judge_tokens_ratio" "$out/judge.log" >> "$summary"
}
# last in its part: it gets what the tests left of the deadline
step_e1p7_compile() {
  if [ -n "$compile" ]; then
    run e1p7_compile 130 python3 bench/engine.py --device cuda --model "$models/m1p7r" \
      --tokens 128 --concurrency 64 --skip-micro --rounds 1 --anchors step --compile \
      --json "$out/e1p7_compile.json"
    side_by_side e1p7_compile
    grep -hE "engine log: .*(captured|compil|capture:|warm-up)" "$out/e1p7_compile.log" >> "$summary"
  else
    say "--- e1p7_compile: bench/engine.py has no --compile, skipped"
  fi
}
# part binv: --batch-invariant on CUDA (the Triton kernels), its tests, then its cost
step_binv_tests() {
  binv_cache=$models/gscache-binv  # smollm2-135m here is m135r: random weights, the same shape
  mkdir -p "$binv_cache/models"
  ln -sfn "$models/m135r" "$binv_cache/models/smollm2-135m-instruct-v1"
  binv_lane() {
    local entry file
    for entry in "$@"; do
      file=${entry%%:*}
      run "binv_$(basename "$file" .py)" "${entry##*:}" \
        env GUARDSTREAM_TEST_DEVICE=cuda GUARDSTREAM_CACHE="$binv_cache" \
        python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$file"
    done
  }
  binv_lane tests/test_invariant_kernels.py:90 tests/test_engine_batch_invariant.py:200 &
  binv_lane tests/test_migration_batch_invariant.py:240 &
  wait
  for name in test_invariant_kernels test_engine_batch_invariant test_migration_batch_invariant; do
    [ -f "$out/binv_$name.log" ] || continue
    say "--- binv_$name:"
    grep -E "^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|skipped|error)" "$out/binv_$name.log" | tail -25 >> "$summary"
  done
}
step_binv() {
  run binv 240 python3 bench/engine.py --device cuda --model "$models/m135r" --tokens 64 \
    --concurrency 1,64,256 --skip-micro --rounds 1 --anchors none --batch-invariant \
    --extra-args="--dtype bfloat16" --json "$out/binv.json"
  grep -E "streams: +[0-9.]+ tok/s aggregate|streams: default .*batch-invariant|engine log: .*(kernels|captured)" \
    "$out/binv.log" >> "$summary"
}
# the steps in the order asked for (a part's own order, or CHECK_STEPS'), each a function above
for step in $steps; do
  "step_$step"
done
say "=== done in $(elapsed) s"
if [ -n "$rehearse" ]; then
  errors=$(command grep -c '^REHEARSAL: step ' "$summary")
  [ "$errors" -eq 0 ] && { say "=== rehearsal passed"; exit 0; }
  say "=== rehearsal FAILED: $errors REHEARSAL lines above"
  exit 1
fi
