#!/usr/bin/env bash
# The whole GPU suite in one call (what every session and reviewer runs on the device):
#   scripts/gpu_suite.sh [warm] [tests] [bench] [compile]     (default: all)
# Logs go to $OUT (or ./gpu-logs); a short summary is printed last. PYTEST_WORKERS (default 12)
# sets the test processes; BENCH_ARGS is added to the cuflash-bench command line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-warm tests bench compile}
summary=()
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__)" 2>&1
  echo "commit ${CUFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
} > "$OUT/env.txt" 2>&1
for stage in $stages; do
  case $stage in
    warm)  # build every variant for this GPU in parallel, into CuPy's disk cache
      summary+=("warm: $(python3 -m cuflash.compile_check --warm 2>&1 | tail -n 1)")
      ;;
    tests)  # -v: every result line names its test as it lands, so a cut-off run still says which failed
      python3 -m pytest tests -v -rs -p no:cacheprovider -n "${PYTEST_WORKERS:-12}" 2>&1 | tee "$OUT/tests.log" >/dev/null
      summary+=("tests: $(tail -n 1 "$OUT/tests.log")")
      failed=$(grep -E " (FAILED|ERROR) tests/" "$OUT/tests.log" | sed 's/^.* \(FAILED\|ERROR\) /\1 /' | sort -u)
      [ -n "$failed" ] && summary+=("$failed")
      ;;
    bench)  # cuflash-bench: speed, memory, IO and block-sparse tables
      python3 -m bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" 2>"$OUT/bench.err" | tee "$OUT/bench.md"
      summary+=("bench: rc=${PIPESTATUS[0]} (tables above, $OUT/bench.md)")
      ;;
    compile)
      python3 -m cuflash.compile_check > "$OUT/compile_check.txt" 2>&1
      summary+=("compile: $(tail -n 1 "$OUT/compile_check.txt")")
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo; echo "== summary =="; cat "$OUT/env.txt"; printf '%s\n' "${summary[@]}"
