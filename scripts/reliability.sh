#!/usr/bin/env bash
# The reliability checks on one GPU, in one command sized to finish within 9 minutes on an H100
# with 16 cores:
#   scripts/reliability.sh [--out] DIR
# 1. warm: every kernel variant built into CuPy's disk cache (python -m cuflash.compile_check --warm).
# 2. side by side, each within SANITIZE_SECONDS (330):
#    - compute-sanitizer memcheck, then initcheck, over scripts/sanitize_cases.py's whole case list,
#    - compute-sanitizer synccheck, then racecheck, over its one-run-a-variant list
#      (both through scripts/sanitize.sh, SANITIZE_SHARDS (6) processes a tool),
#    - the GPU fuzz, bad-input and validation tests (PYTEST_WORKERS (2) processes).
# 3. the soak alone, so that its memory samples are its own (scripts/soak.py, SOAK_SECONDS (120)).
# Each stage logs to DIR (warm.log, sanitize/, sanitize-sync/, tests.log, soak/); the summary is
# printed last and kept in DIR/summary.txt. Exits 1 if a stage failed, was cut off or left no
# summary; 2 on bad arguments.
set -uo pipefail
[ "${1:-}" = --out ] && shift
[ $# -eq 1 ] && [ -n "$1" ] || { echo "usage: scripts/reliability.sh [--out] DIR" >&2; exit 2; }
mkdir -p "$1" && dir=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SANITIZE_SHARDS=${SANITIZE_SHARDS:-6}
sanitize_seconds=${SANITIZE_SECONDS:-330}
soak_seconds=${SOAK_SECONDS:-120}
status=0
summary=()
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)"
  git rev-parse --short HEAD
} > "$dir/env.txt" 2>&1

start=$SECONDS
python3 -m cuflash.compile_check --warm > "$dir/warm.log" 2>&1 || status=1
summary+=("warm: $(tail -n 1 "$dir/warm.log") ($((SECONDS - start)) s)")

# Stage 2. The sanitizer's shards write their logs under DIR (TMPDIR, for sanitize.sh's
# mktemp): a run cut off by its time limit still shows what it found.
start=$SECONDS
mkdir -p "$dir/sanitize-parts"
TMPDIR="$dir/sanitize-parts" timeout --kill-after=10 "$sanitize_seconds" \
  scripts/sanitize.sh --out "$dir/sanitize" memcheck initcheck > "$dir/sanitize.out" 2>&1 &
full=$!
TMPDIR="$dir/sanitize-parts" timeout --kill-after=10 "$sanitize_seconds" \
  scripts/sanitize.sh --out "$dir/sanitize-sync" synccheck racecheck > "$dir/sanitize-sync.out" 2>&1 &
sync=$!
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout --kill-after=10 "$sanitize_seconds" \
  python3 -m pytest tests/test_fuzz_gpu.py tests/test_bad_inputs.py tests/test_validate.py -q -rfEs \
  -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" > "$dir/tests.log" 2>&1 &
tests=$!
for job in full sync; do
  wait "${!job}"
  rc=$?
  [ "$rc" -ne 0 ] && status=1
  log="$dir/sanitize$([ $job = sync ] && echo -sync).out"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    found=$(cat "$dir"/sanitize-parts/*/*.log 2>/dev/null | grep -h "SUMMARY" | sort | uniq -c | paste -sd ';' -)
    summary+=("sanitizer ($job): CUT OFF after $sanitize_seconds s; so far: ${found:-no SUMMARY line}")
  else
    summary+=("$(sed -n '/^== compute-sanitizer/,$p' "$log" | tail -n +2)")
  fi
done
wait "$tests"
rc=$?
[ "$rc" -ne 0 ] && status=1
summary+=("fuzz, bad-input and validation tests: $(tail -n 1 "$dir/tests.log") (rc=$rc)")
summary+=("sanitizer and tests: $((SECONDS - start)) s")

start=$SECONDS
timeout --kill-after=10 $((soak_seconds + 60)) python3 scripts/soak.py --seconds "$soak_seconds" \
  --out "$dir/soak" > "$dir/soak.log" 2>&1
rc=$?
[ "$rc" -ne 0 ] && status=1
if [ -f "$dir/soak/soak.txt" ]; then
  summary+=("$(cat "$dir/soak/soak.txt")")
else
  status=1
  summary+=("soak: rc=$rc, no summary (see $dir/soak.log)")
fi
summary+=("soak stage: $((SECONDS - start)) s")

{
  echo "== reliability (logs in $dir) =="
  cat "$dir/env.txt"
  printf '%s\n' "${summary[@]}"
  echo "total: $SECONDS s; $([ "$status" -eq 0 ] && echo PASS || echo FAIL)"
} | tee "$dir/summary.txt"
exit $status
