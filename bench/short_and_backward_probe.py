"""Probe of three things the default bench does not separate (results: bench/results/probes/):

- host: host time of one small call (cProfile's top entries), cuflash against SDPA;
- short: the wgmma forward at seq 512-4096 with the batch x 16 at 512-1024, so that the GPU
  queue hides host time, in several schedules, against SDPA flash and cuDNN;
- backward: the wgmma key pass (dQ by vector atomics, by bulk reductions, deterministic)
  against mma.sync and SDPA.

    python bench/short_and_backward_probe.py [--sections host short backward]
"""

import argparse
import cProfile
import io
import pstats
import time

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from cuflash import _config
from sm90_probe import time_ms  # run as bench/short_and_backward_probe.py: bench/ is on the path

sdpa = torch.nn.functional.scaled_dot_product_attention
PEERS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def host(stream):
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)

    def ours():
        with stream:
            cuflash.attention(q, q, q)

    for name, fn in (("cuflash", ours), ("sdpa", lambda: sdpa(q, q, q))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        print(f"host {name}: {(time.perf_counter() - start) / 500 * 1e6:.1f} us/call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        ours()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue()[-3500:])


def short(stream):
    schedules = [(128, 3, 0, 1, 1, 0), (128, 3, 0, 0, 1, 0), (128, 3, 0, 1, 1, 1), (128, 3, 0, 0, 1, 1)]
    print("fwd (x16 batch below 4096) hd causal seq | " + " | ".join(map(str, schedules)) + " | sdpa_flash | cudnn")
    for hd in (64, 128):
        for causal in (False, True):
            for seq in (512, 1024, 4096):
                batch, heads = (16 if seq < 4096 else 1) * 16384 // seq, 2048 // hd
                q, k, v = (torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * seq * seq * hd * heads * batch / (2 if causal else 1)
                row = []
                for bc, stages, *flags in schedules:
                    def run():
                        with stream:
                            cuflash.attention(q, k, v, causal=causal)

                    with _config.sm90_tiles_override({hd: (bc, stages, *map(bool, flags))}):
                        row.append(time_ms(run))
                for peer in PEERS:
                    with sdpa_kernel(peer):
                        row.append(time_ms(lambda: sdpa(q, k, v, is_causal=causal)))
                print(f"{hd} {int(causal)} {seq} | " + " | ".join(f"{flops / t / 1e9:.0f}" for t in row), flush=True)


BACKWARD_FORMS = ((True, False, False), (True, True, False), (True, False, True), (False, False, False))  # wgmma, bulk, det.


def warm_backward():
    """Build every backward kernel the probe runs, in parallel processes, before timing."""
    from cuflash import compile_check

    needed = {}
    for hd in (64, 128):
        for causal in (False, True):
            for wgmma, bulk, deterministic in BACKWARD_FORMS:
                with _config.wgmma_backward(wgmma), _config.sm90_bulk_dq(bulk):
                    plan = _config.backward_plan("bfloat16", hd, hd, causal, deterministic, wgmma=True)
                for kernel in (plan.preprocess, *plan.key_passes, plan.dq):
                    if kernel is not None:
                        needed[kernel.key] = kernel
    compile_check.warm(variants=needed.values())


def backward(stream):
    warm_backward()
    print("bwd hd causal seq | wgmma atomic | wgmma bulk dQ | wgmma det | mma.sync | sdpa_flash | cudnn")
    for hd in (64, 128):
        for causal in (False, True):
            for seq in (1024, 4096, 16384):
                batch, heads = 16384 // seq, 2048 // hd
                q, k, v, do = (torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                with stream:
                    o, l, m = cuflash.attention(q, k, v, causal=causal)
                flops = 2.5 * 4 * seq * seq * hd * heads * batch / (2 if causal else 1)
                row = []
                for wgmma, bulk, deterministic in BACKWARD_FORMS:
                    def run():
                        with stream:
                            cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal, deterministic=deterministic)

                    with _config.wgmma_backward(wgmma), _config.sm90_bulk_dq(bulk):
                        row.append(time_ms(run))
                for peer in PEERS:
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    with sdpa_kernel(peer):
                        out = sdpa(*leaves, is_causal=causal)
                    row.append(time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)))
                print(f"{hd} {int(causal)} {seq} | " + " | ".join(f"{flops / t / 1e9:.0f}" for t in row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", choices=("host", "short", "backward"),
                        default=["host", "short", "backward"])
    args = parser.parse_args()
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for section in args.sections:
        {"host": host, "short": short, "backward": backward}[section](stream)


if __name__ == "__main__":
    main()
