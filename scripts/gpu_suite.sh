#!/usr/bin/env bash
# The whole GPU suite, sized to finish within 600 s on an H100/H200:
#   scripts/gpu_suite.sh [--out DIR] [warm] [tests] [bench] [compile]   (default: warm tests bench)
# Logs go to DIR (default ./gpu-logs; a relative DIR is taken from the directory the script is
# started in); a short summary is printed last. The stages share SUITE_SECONDS (570, leaving
# the last 30 s of the 600 for the summary and a killed stage's 10 s of grace): the tests stop
# where the bench's share (BENCH_SECONDS, 270; the default run took 254 s at 9e72cb2,
# compilation included) would start, and the bench gets what is left, so a slow test cannot
# take the bench's turn (at 9e72cb2, on a machine with a slower CPU, warm and tests ended at
# 266 s); with pytest-timeout installed a test running past TEST_TIMEOUT (180 s) fails by name
# instead. The tests stage runs the tests marked with TEST_MARKERS (default "not nvrtc": the
# NVRTC builds of every variant need no GPU and run in CI, and on a GPU machine they compete
# with the GPU tests for the CPU; TEST_MARKERS="" runs everything). TEST_LIST, a file of test
# node ids (one a line), narrows the tests to those (say, the failures of an earlier run).
# PYTEST_WORKERS (default 12) sets the test processes; BENCH_ARGS is added to the cuflash-bench
# command line.
set -uo pipefail
. "$(dirname "$0")/suite_args.sh"
parse_suite_args "usage: scripts/gpu_suite.sh [--out DIR] [warm] [tests] [bench] [compile]" gpu-logs \
  "warm tests bench compile" "$@" || exit 2
stages=("${chosen[@]}")
[ ${#stages[@]} -eq 0 ] && stages=(warm tests bench)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
suite=${SUITE_SECONDS:-570}
bench_share=${BENCH_SECONDS:-270}
markers=${TEST_MARKERS-not nvrtc}
summary=()
left() { local n=$((suite - SECONDS - ${1:-0})); echo $((n > 30 ? n : 30)); }  # never 0: timeout 0 waits forever
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__)" 2>&1
  python3 -c "import jax; print('jax', jax.__version__)" 2>&1 | tail -n 1
  python3 -c "from cuflash.bench.common import git_commit; print('commit', git_commit())"
} > "$out/env.txt" 2>&1
for stage in "${stages[@]}"; do
  case $stage in
    warm)  # build every variant for this GPU in parallel, into CuPy's disk cache
      summary+=("warm: $(python3 -m cuflash.compile_check --warm 2>&1 | tail -n 1) ($SECONDS s)")
      ;;
    tests)  # -v: every result line names its test as it lands, so a cut-off run still says which ran;
      # CUFLASH_TEST_TIMES (tests/conftest.py): every test's time, to keep the suite inside its time
      # One BLAS thread a worker: twelve workers each spinning sixteen OpenBLAS threads on sixteen
      # cores made the float64 references crawl (some tests took 64-87 s each; bench/NOTES.md, Tools).
      export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
      budget=$(left)
      [[ " ${stages[*]} " == *" bench "* ]] && budget=$(left "$bench_share")
      extra=()
      [ -n "$markers" ] && extra+=(-m "$markers")
      targets=(tests)
      [ -n "${TEST_LIST:-}" ] && mapfile -t targets < "$TEST_LIST"
      python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout "${TEST_TIMEOUT:-180}")
      CUFLASH_TEST_TIMES="$out/test_times.txt" timeout --kill-after=10 "$budget" python3 -m pytest "${targets[@]}" -v -rs -p no:cacheprovider \
        -n "${PYTEST_WORKERS:-12}" "${extra[@]}" 2>&1 | tee "$out/tests.log" >/dev/null
      rc=${PIPESTATUS[0]}
      if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        passed=$(grep -cE ' PASSED ' "$out/tests.log"); failures=$(grep -cE ' (FAILED|ERROR) ' "$out/tests.log")
        summary+=("tests: CUT OFF after $budget s: $passed passed, $failures failed so far")
      else
        summary+=("tests (${markers:-all}): $(tail -n 1 "$out/tests.log") ($SECONDS s)")
      fi
      [ -f "$out/test_times.txt" ] && sort -rn "$out/test_times.txt" -o "$out/test_times.txt"
      failed=$(grep -E " (FAILED|ERROR) tests/" "$out/tests.log" | sed 's/^.* \(FAILED\|ERROR\) /\1 /' | sort -u)
      [ -n "$failed" ] && summary+=("$failed")
      ;;
    bench)  # cuflash-bench, the default run: speed, memory, io, sparse, host and e2e tables
      plot=(--plot "$out/bench.png")  # the plot draws the speed table: only where one is made
      [[ "${BENCH_ARGS:-}" == *--tables* && "${BENCH_ARGS:-}" != *speed* ]] && plot=()
      timeout --kill-after=10 "$(left)" python3 -m bench ${BENCH_ARGS:-} --json "$out/bench.json" \
        --csv "$out/bench.csv" "${plot[@]}" 2>"$out/bench.err" | tee "$out/bench.md"
      summary+=("bench: rc=${PIPESTATUS[0]} ($SECONDS s; tables above, $out/bench.md)")
      ;;
    compile)  # NVRTC's report of every variant (CI builds them too); not in the default stages
      python3 -m cuflash.compile_check > "$out/compile_check.txt" 2>&1
      summary+=("compile: $(tail -n 1 "$out/compile_check.txt")")
      ;;
  esac
done
echo; echo "== summary =="; cat "$out/env.txt"; printf '%s\n' "${summary[@]}"
