#!/usr/bin/env bash
# compute-sanitizer over every kernel variant the dispatcher can pick (the cases are in
# scripts/sanitize_cases.py):
#   scripts/sanitize.sh [LOGDIR] [TOOL ...]
# LOGDIR defaults to $OUT/sanitize, or ./sanitize-logs without $OUT; TOOL is any of memcheck,
# initcheck, synccheck, racecheck (default: all four). memcheck and initcheck run the whole case
# matrix; racecheck and synccheck, many times slower, run one case per variant. Each tool runs
# the cases in SANITIZE_SHARDS (default 4) processes side by side. Prints one summary line per
# tool (error counts per shard, coverage over all shards) and exits 1 if any tool found an
# error or the driver failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then logs=${1:-$OUT/sanitize}; else logs=${1:-sanitize-logs}; fi
[ $# -gt 0 ] && shift
tools=${*:-memcheck initcheck synccheck racecheck}
shards=${SANITIZE_SHARDS:-4}
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Build every variant once, outside the sanitizer; each tool's run then loads them from CuPy's
# disk cache instead of compiling under instrumentation.
python3 -m cuflash.compile_check --warm > "$logs/warm.log" 2>&1 || echo "warm failed: see $logs/warm.log"
status=0
summary=()
for tool in $tools; do
  case $tool in
    memcheck|initcheck) subset=all ;;
    synccheck|racecheck) subset=one ;;
    *) echo "unknown tool $tool (memcheck, initcheck, synccheck, racecheck)"; exit 2 ;;
  esac
  start=$SECONDS
  # The case list in $shards interleaved slices, each under its own sanitizer process side by
  # side (the tools are CPU-bound: racecheck took 389 s in one process); one log per tool.
  parts=$(mktemp -d)
  for ((k = 0; k < shards; k++)); do
    "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 \
      python3 scripts/sanitize_cases.py --subset "$subset" --shard "$k/$shards" \
      --launched "$parts/$k.keys" > "$parts/$k.log" 2>&1 &
  done
  rc=0
  for job in $(jobs -p); do wait "$job" || rc=1; done
  [ "$rc" -ne 0 ] && status=1
  for ((k = 0; k < shards; k++)); do echo "==== shard $k/$shards"; cat "$parts/$k.log"; done > "$logs/$tool.log"
  counts=$(grep -h "SUMMARY" "$logs/$tool.log" | sed 's/^=* *//' | sort | uniq -c | sed 's/^ *//' | paste -sd ';' -)
  if [ "$(ls "$parts"/*.keys 2>/dev/null | wc -l)" -eq "$shards" ]; then
    covered=$(python3 scripts/sanitize_cases.py --coverage "$parts"/*.keys 2>&1 | tail -n 1)
  else
    covered="a shard did not finish"
  fi
  rm -rf "$parts"
  summary+=("$tool ($subset, $shards shards): rc=$rc; ${counts:-no SUMMARY line}; ${covered}; $((SECONDS - start)) s")
done
echo "== compute-sanitizer (logs in $logs) =="
printf '%s\n' "${summary[@]}"
exit $status
