#!/usr/bin/env bash
# compute-sanitizer over every kernel variant the dispatcher can pick (the cases are in
# scripts/sanitize_cases.py):
#   scripts/sanitize.sh [--out DIR] [TOOL ...]
# Logs go to DIR (default ./sanitize-logs; a relative DIR is taken from the directory the script
# is started in); TOOL is any of memcheck, initcheck, synccheck, racecheck (default: all four).
# memcheck and initcheck run the whole case matrix; racecheck and synccheck, many times slower,
# run one case per variant. Each tool runs the cases in SANITIZE_SHARDS (default 4) processes
# side by side. Prints one summary line per tool (error counts per shard, coverage over all
# shards) and exits 1 if any tool found an error or the driver failed. racecheck's reports are
# all displayed and sorted by scripts/racecheck_hazards.py (DIR/racecheck-hazards.txt) against
# the cubins that ran: the writes of asynchronous copies that racecheck cannot order are
# counted apart, and any other race, or a report it could not sort, fails the run.
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
version=$("$sanitizer" --version 2>/dev/null | sed -n 's/^Version \([^ ]*\).*/\1/p')
# racecheck stops recording past this many hazards, and the async-copy writes it cannot order
# (scripts/racecheck_hazards.py) passed its default of 10 million in some shards: what ran after
# went unchecked. Host memory at this limit is not measured.
export NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=${NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS:-100000000}
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
  if [ "$tool" = racecheck ]; then  # judged by racecheck_hazards.py: its exit status is the cases'
    tool_args=(--print-limit 0)
    case_args=(--cubins "$parts/cubins")
  else
    tool_args=(--error-exitcode 1 --print-limit 20)
    case_args=()
  fi
  for ((k = 0; k < shards; k++)); do
    "$sanitizer" --tool "$tool" "${tool_args[@]}" \
      python3 scripts/sanitize_cases.py --subset "$subset" --shard "$k/$shards" \
      --launched "$parts/$k.keys" "${case_args[@]}" > "$parts/$k.log" 2>&1 &
  done
  rc=0
  for job in $(jobs -p); do wait "$job" || rc=1; done
  for ((k = 0; k < shards; k++)); do echo "==== shard $k/$shards"; cat "$parts/$k.log"; done > "$out/$tool.log"
  counts=$(grep -h "SUMMARY" "$out/$tool.log" | sed 's/^=* *//' | sort | uniq -c | sed 's/^ *//' | paste -sd ';' -)
  if [ "$tool" = racecheck ]; then
    python3 scripts/racecheck_hazards.py --cubins "$parts/cubins" "$out/$tool.log" > "$out/racecheck-hazards.txt" 2>&1 \
      || rc=1
    counts="${counts:-no SUMMARY line}; $(tail -n 1 "$out/racecheck-hazards.txt")"
  fi
  [ "$rc" -ne 0 ] && status=1
  if [ "$(ls "$parts"/*.keys 2>/dev/null | wc -l)" -eq "$shards" ]; then
    covered=$(python3 scripts/sanitize_cases.py --coverage "$parts"/*.keys 2>&1 | tail -n 1)
  else
    covered="a shard did not finish"
  fi
  rm -rf "$parts"
  summary+=("$tool ($subset, $shards shards): rc=$rc; ${counts:-no SUMMARY line}; ${covered}; $((SECONDS - start)) s")
done
echo "== compute-sanitizer${version:+ $version} (logs in $out) =="
printf '%s\n' "${summary[@]}"
exit $status
