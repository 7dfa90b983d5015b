"""Quick timing of one shape: cuflash against SDPA flash (tuning runs, not the report)."""
import sys, statistics
import torch, cupy
import cuflash
from cuflash import _config

seq, hd, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
tiles = [tuple(map(int, t.split(","))) for t in sys.argv[4:]] or [None]
b, h = 16384 // seq, 2048 // hd
sets = [[torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(4)]
flops = 4 * seq * seq * hd * h * b / (2 if causal else 1)
stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

def bench(fn):
    for i in range(3): fn(*sets[i % 4])
    ts = []
    for i in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(*sets[i % 4]); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    ms = statistics.median(ts)
    return ms, flops / ms / 1e9

from torch.nn.attention import sdpa_kernel, SDPBackend
def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
print(f"seq {seq} hd {hd} causal {causal}: sdpa_flash %.3f ms %.1f TF" % bench(sdpa))
for t in tiles:
    def cf(q, k, v):
        with stream:
            return cuflash.attention(q, k, v, causal=causal)
    if t is None:
        print("  cuflash default %.3f ms %.1f TF" % bench(cf))
    else:
        with _config.forward_tiles_override({_config.head_dim_bucket(hd): t}):
            print(f"  cuflash {t} %.3f ms %.1f TF" % bench(cf))
