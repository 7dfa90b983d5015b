"""One backward launch at a benchmark shape, for ncu / compute-sanitizer to look at.

    python bench/profile_bwd.py SEQ HDIM CAUSAL [tiles...]   (tiles as in bench/quick_bwd.py)
"""
import sys

import cupy

import cuflash
from cuflash import _config

seq, hd, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
tiles = [tuple(map(int, t.split(","))) for t in sys.argv[4:]]
b, h = 16384 // seq, 2048 // hd
rng = cupy.random.default_rng(0)
q, k, v, do = (rng.standard_normal((b, h, seq, hd), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
o, l, m = cuflash.attention(q, k, v, causal=causal)
for t in tiles or [None]:
    override = _config.backward_tiles_override({_config.head_dim_bucket(hd): t}) if t else _config.backward_tiles_override({})
    with override:
        cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal)
cupy.cuda.Device().synchronize()
