#!/bin/bash
# bench/gpu/check.sh rehearsed on this CPU (CHECK_REHEARSE=1), before a lent GPU session: every
# step's own command line on the CPU at rehearsal sizes, the test lanes collected, every grep of
# the summary checked against its log, the imports limited to the GPU image and the bundle.
#   bash bench/gpu/rehearse.sh [PART[:STEP,STEP...] ...]   (from the project root; `make gpu-rehearsal`)
# Default: the parts bench, tests and binv, and the step e135_oneproc (only in part all). One
# offline bundle (bundle.sh --offline: tok/ and the wheels' names) and one models folder of tiny
# random models for all of them, in REHEARSE_DIR (default: a new /tmp/gpu-rehearsal.*); each
# part's logs and summary.txt in REHEARSE_DIR/PART. CHECK_PYTHON: the venv (default .venv).
# Exit 1 when any part has a "REHEARSAL: step X: ..." line (printed at the end).
set -u
work=${REHEARSE_DIR:-$(mktemp -d /tmp/gpu-rehearsal.XXXXXX)}
mkdir -p "$work"
bash bench/gpu/bundle.sh --offline "$work/bundle" || exit 1
status=0
for entry in ${@:-bench tests binv all:e135_oneproc}; do
  part=${entry%%:*}
  steps=""
  [ "$entry" != "$part" ] && steps=${entry#*:} && steps=${steps//,/ }
  dir=$work/${entry//[:,]/-}
  start=$(date +%s)
  CHECK_REHEARSE=1 CHECK_STEPS=$steps CHECK_PART=$part OUT=$dir \
    bash bench/gpu/check.sh "$work/bundle" "$work/models" > "$dir.out" 2>&1 || status=1
  echo "rehearsal of $entry: $(($(date +%s) - start)) s, $(grep -c '^REHEARSAL: step ' "$dir/summary.txt") problems ($dir/summary.txt)"
  grep '^REHEARSAL: step ' "$dir/summary.txt"
done
exit $status
