#!/usr/bin/env bash
# One device call for the untested switches of session 6 (fits the 600 s call limit):
#   scripts/probe_wip.sh        logs in $OUT (or ./gpu-logs), a short summary last
# 1. their GPU tests, named as they land (-v): the persistent grid with four items a CTA in
#    every order and hand-off, and every schedule; 2. the forward probe, each head dim at its
#    table's schedule: one item a CTA, the persistent TMA form as it is, with early_next (8th
#    number), with early_next and snake (9th), at seq 512-1024 (16x the tokens, so that the GPU
#    queue hides host time) and 4096-16384 (256: 4096), causal and not.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
python3 -m cuflash.compile_check --warm > "$OUT/warm.log" 2>&1
timeout 200 python3 -m pytest tests/test_forward_sm90_gpu.py tests/test_compile.py -k "persistent_grid or every_schedule or probe" \
  -v -p no:cacheprovider -n 8 > "$OUT/tests.log" 2>&1
tests="tests: $(tail -n 1 "$OUT/tests.log") ($((SECONDS - start)) s); $(grep -E ' (FAILED|ERROR) tests/' "$OUT/tests.log" | sed 's/^.* \(FAILED\|ERROR\) /\1 /' | sort -u | paste -sd ';' -)"
probe() {  # name hdim "configs" seqlens... ; short lengths get 16x the tokens
  local name=$1 hd=$2 configs=$3; shift 3
  timeout 90 python3 bench/sm90_probe.py --hdims "$hd" --seqlens 512 1024 --tokens 262144 --configs $configs > "$OUT/$name.txt" 2>&1
  timeout 90 python3 bench/sm90_probe.py --hdims "$hd" --seqlens "$@" --configs $configs 2>&1 | tail -n +2 >> "$OUT/$name.txt"
}
probe probe_hd64 64 "128,3,1,1,1,0 128,3,1,1,1,1 128,3,1,1,1,1,0,1 128,3,1,1,1,1,0,1,1" 4096 16384
probe probe_hd128 128 "128,3,0,0,1,0 128,3,0,0,1,1 128,3,0,0,1,1,0,1 128,3,0,0,1,1,0,1,1" 4096 16384
probe probe_hd256 256 "64,2,0,1,1,0 64,2,0,1,1,1 64,2,0,1,1,1,0,1 64,2,0,1,1,1,0,1,1" 4096
echo "== summary ($((SECONDS - start)) s) =="
echo "$tests"
for f in probe_hd64 probe_hd128 probe_hd256; do echo "-- $f"; tail -n 13 "$OUT/$f.txt"; done
