"""Probe: host time per call, the wgmma forward at short lengths with the batch x 16 (host time hidden),
and the wgmma backward key pass against mma.sync and SDPA (results: bench/results/probes/host-fwd-bwd-probe-*.txt)."""
import cProfile, io, pstats, statistics, time
import cupy, torch
import cuflash
from cuflash import _config
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional.scaled_dot_product_attention
stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

def time_ms(fn, repeats=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

# 1. host overhead per call, tiny input
q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
def ours():
    with stream: cuflash.attention(q, q, q)
for name, fn in (("cuflash", ours), ("sdpa", lambda: F(q, q, q))):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(500): fn()
    torch.cuda.synchronize(); print(f"host {name}: {(time.perf_counter() - t) / 500 * 1e6:.1f} us/call")
pr = cProfile.Profile(); pr.enable()
for _ in range(300): ours()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-3500:])

# 2. forward kernel efficiency at short seqs: batch x16 so the host cost hides
print("fwd (x16 batch) hd causal seq | cfgs... | sdpa_flash | cudnn")
cfgs = [(128, 3, 0, 1, 1, 0), (128, 3, 0, 0, 1, 0), (128, 3, 0, 1, 1, 1), (128, 3, 0, 0, 1, 1)]
for hd in (64, 128):
    for causal in (False, True):
        for seq in (512, 1024, 4096):
            b, h = 16 * 16384 // seq, 2048 // hd
            if seq == 4096: b //= 16
            q, k, v = (torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = 4 * seq * seq * hd * h * b / (2 if causal else 1)
            row = []
            for c in cfgs:
                with _config.sm90_tiles_override({hd: (c[0], c[1], *map(bool, c[2:]))}):
                    def f():
                        with stream: cuflash.attention(q, k, v, causal=causal)
                    row.append(time_ms(f))
            for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                with sdpa_kernel(be): row.append(time_ms(lambda: F(q, k, v, is_causal=causal)))
            print(f"{hd} {int(causal)} {seq} | " + " | ".join(f"{fl / t / 1e9:.0f}" for t in row), flush=True)
            del q, k, v

# 3. backward: wgmma draft vs mma.sync vs sdpa
print("bwd hd causal seq | wgmma atomic | wgmma det | mma.sync | sdpa_flash | cudnn")
for hd in (64, 128):
    for causal in (False, True):
        for seq in (1024, 4096, 16384):
            b, h = 16384 // seq, 2048 // hd
            q, k, v, do = (torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            with stream: o, l, m = cuflash.attention(q, k, v, causal=causal)
            fl = 2.5 * 4 * seq * seq * hd * h * b / (2 if causal else 1)
            row = []
            for on, det in ((True, False), (True, True), (False, False)):
                with _config.wgmma_backward(on):
                    def f():
                        with stream: cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal, deterministic=det)
                    row.append(time_ms(f))
            for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(be): out = F(qq, kk, vv, is_causal=causal)
                row.append(time_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)))
            print(f"{hd} {int(causal)} {seq} | " + " | ".join(f"{fl / t / 1e9:.0f}" for t in row), flush=True)
