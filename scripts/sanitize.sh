#!/usr/bin/env bash
# compute-sanitizer over every kernel variant the dispatcher can pick (the cases are in
# scripts/sanitize_cases.py):
#   scripts/sanitize.sh [LOGDIR] [TOOL ...]
# LOGDIR defaults to $OUT/sanitize, or ./sanitize-logs without $OUT; TOOL is any of memcheck,
# initcheck, synccheck, racecheck (default: all four). memcheck and initcheck run the whole case
# matrix; racecheck and synccheck, many times slower, run one case per variant. Prints one
# summary line per tool and exits 1 if any tool found an error or the driver failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then logs=${1:-$OUT/sanitize}; else logs=${1:-sanitize-logs}; fi
[ $# -gt 0 ] && shift
tools=${*:-memcheck initcheck synccheck racecheck}
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
  "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 \
    python3 scripts/sanitize_cases.py --subset "$subset" > "$logs/$tool.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && status=1
  counts=$(grep -h "SUMMARY" "$logs/$tool.log" | sed 's/^=* *//' | paste -sd ';' -)
  covered=$(grep -h "^covered" "$logs/$tool.log" | tail -n 1)
  summary+=("$tool ($subset): rc=$rc; ${counts:-no SUMMARY line}; ${covered:-driver did not finish}; $((SECONDS - start)) s")
done
echo "== compute-sanitizer (logs in $logs) =="
printf '%s\n' "${summary[@]}"
exit $status
