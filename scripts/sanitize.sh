#!/usr/bin/env bash
# compute-sanitizer over every kernel variant the dispatcher can pick (the cases are in
# scripts/sanitize_cases.py):
#   scripts/sanitize.sh [--out DIR] [TOOL ...]
# Logs go to DIR (default ./sanitize-logs; a relative DIR is taken from the directory the script
# is started in); TOOL is any of memcheck, initcheck, synccheck, racecheck (default: all four).
# memcheck and initcheck run the whole case matrix; racecheck and synccheck, many times slower,
# run one case per variant. Each tool runs the cases in SANITIZE_SHARDS (default 4) processes
# side by side. Prints one summary line per tool (error counts per shard, coverage over all
# shards) and exits 1 if any tool found an error or the driver failed.
set -uo pipefail
. "$(dirname "$0")/suite_args.sh"
parse_suite_args "usage: scripts/sanitize.sh [--out DIR] [memcheck] [initcheck] [synccheck] [racecheck]" \
  sanitize-logs "memcheck initcheck synccheck racecheck" "$@" || exit 2
tools=("${chosen[@]}")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck initcheck synccheck racecheck)
cd "$(dirname "$0")/.."
shards=${SANITIZE_SHARDS:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Build every variant once, outside the sanitizer; each tool's run then loads them from CuPy's
# disk cache instead of compiling under instrumentation.
python3 -m cuflash.compile_check --warm > "$out/warm.log" 2>&1 || echo "warm failed: see $out/warm.log"
status=0
summary=()
for tool in "${tools[@]}"; do
  case $tool in
    memcheck|initcheck) subset=all ;;
    synccheck|racecheck) subset=one ;;
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
  for ((k = 0; k < shards; k++)); do echo "==== shard $k/$shards"; cat "$parts/$k.log"; done > "$out/$tool.log"
  counts=$(grep -h "SUMMARY" "$out/$tool.log" | sed 's/^=* *//' | sort | uniq -c | sed 's/^ *//' | paste -sd ';' -)
  if [ "$(ls "$parts"/*.keys 2>/dev/null | wc -l)" -eq "$shards" ]; then
    covered=$(python3 scripts/sanitize_cases.py --coverage "$parts"/*.keys 2>&1 | tail -n 1)
  else
    covered="a shard did not finish"
  fi
  rm -rf "$parts"
  summary+=("$tool ($subset, $shards shards): rc=$rc; ${counts:-no SUMMARY line}; ${covered}; $((SECONDS - start)) s")
done
echo "== compute-sanitizer (logs in $out) =="
printf '%s\n' "${summary[@]}"
exit $status
