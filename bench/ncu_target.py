"""Runs one forward and backward twice, for ncu:  python bench/ncu_target.py HDIM SEQ CAUSAL(0/1)

    ncu -k regex:flash_fwd_sm90 -s 1 -c 1 --section SpeedOfLight ... python bench/ncu_target.py 128 4096 0

bf16, 16k tokens and hidden 2048 as cuflash-bench. Results: bench/results/probes/ncu-*.txt.
"""
import sys

import cupy
import torch

import cuflash

hd, seq, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
b, h = 16384 // seq, 2048 // hd
q, k, v, do = (cupy.from_dlpack(torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16)) for _ in range(4))
for _ in range(2):
    o, l, m = cuflash.attention(q, k, v, causal=causal)
    cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal)
cupy.cuda.Device().synchronize()
