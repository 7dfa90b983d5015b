"""Quick timing of one backward shape: cuflash against SDPA flash (tuning runs, not the report)."""
import statistics
import sys

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

seq, hd, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
det = "det" in sys.argv[4:]
tiles = [tuple(map(int, t.split(","))) for t in sys.argv[4:] if t != "det"]
b, h = 16384 // seq, 2048 // hd
flops = 2.5 * 4 * seq * seq * hd * h * b / (2 if causal else 1)
stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
sets = []
for _ in range(3):
    q, k, v, do = (torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    with stream:
        o, l, m = cuflash.attention(q, k, v, causal=causal)
    sets.append((q, k, v, do, o, l, m))


def bench(fn):
    for i in range(3):
        fn(*sets[i % 3])
    ts = []
    for i in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(*sets[i % 3]); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    ms = statistics.median(ts)
    return ms, flops / ms / 1e9


def cf(q, k, v, do, o, l, m):
    with stream:
        return cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal, deterministic=det)


# time SDPA's backward alone: one forward graph per input set, reused
graphs = []
for q, k, v, do, *_ in sets:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    graphs.append((out, (q, k, v), do))
idx = [0]


def sdpa_bwd(*_):
    out, inputs, do = graphs[idx[0] % 3]
    idx[0] += 1
    return torch.autograd.grad(out, inputs, do, retain_graph=True)


print(f"bwd seq {seq} hd {hd} causal {causal}: sdpa_flash %.3f ms %.1f TF" % bench(sdpa_bwd))
print(f"  cuflash{' deterministic' if det else ''} %.3f ms %.1f TF" % bench(cf))
for t in tiles:  # (query rows, keys, warps, min_blocks) of flash_bwd_kernel
    from cuflash import _config

    with _config.backward_tiles_override({_config.head_dim_bucket(hd): t}):
        print(f"  cuflash {t} %.3f ms %.1f TF" % bench(cf))
