#!/usr/bin/env bash
# One device call for the untested switches of this branch (fits the 600 s call limit):
#   scripts/probe_wip.sh        logs in $OUT (or ./gpu-logs), a short summary last
# 1. their GPU tests, named as they land (-v); 2. the forward probe: exp emulation on the
# default schedules at head dims 64 and 128, and the head-dim-256 wgmma kernel against mma.sync;
# 3. the backward probe (wgmma key pass, atomic and deterministic, against mma.sync and SDPA).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
python3 -m cuflash.compile_check --warm > "$OUT/warm.log" 2>&1
timeout 200 python3 -m pytest tests/test_forward_sm90_gpu.py tests/test_backward_sm90_gpu.py tests/test_poly_exp2.py \
  -v -p no:cacheprovider -n 8 > "$OUT/tests.log" 2>&1
tests="tests: $(tail -n 1 "$OUT/tests.log") ($((SECONDS - start)) s); $(grep -E ' (FAILED|ERROR) tests/' "$OUT/tests.log" | sed 's/^.* \(FAILED\|ERROR\) /\1 /' | sort -u | paste -sd ';' -)"
timeout 150 python3 bench/sm90_probe.py --hdims 64 --seqlens 1024 4096 16384 \
  --configs 128,3,1,1,1,0,0 128,3,1,1,1,0,2 128,3,1,1,1,0,3 128,3,1,1,1,0,4 128,3,0,1,1,0,4 > "$OUT/probe_hd64.txt" 2>&1
timeout 100 python3 bench/sm90_probe.py --hdims 128 --seqlens 4096 16384 \
  --configs 128,3,0,0,1,0,0 128,3,0,0,1,0,4 128,3,1,1,1,0,4 > "$OUT/probe_hd128.txt" 2>&1
timeout 100 python3 bench/sm90_probe.py --hdims 256 --seqlens 1024 4096 16384 \
  --configs 64,2,0,0,1,0 64,2,0,1,1,0 64,2,1,1,1,0 > "$OUT/probe_hd256.txt" 2>&1
timeout 100 python3 bench/short_and_backward_probe.py --sections backward > "$OUT/probe_bwd.txt" 2>&1
timeout 30 python3 bench/host_overhead.py > "$OUT/host.txt" 2>&1
echo "== summary ($((SECONDS - start)) s) =="
echo "$tests"
for f in probe_hd64 probe_hd128 probe_hd256 probe_bwd host; do echo "-- $f"; tail -n 14 "$OUT/$f.txt"; done
