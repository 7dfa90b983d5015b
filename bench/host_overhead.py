"""Host time of one small attention call (1 x 1 x 128 x 64, bf16), where the GPU work is
negligible: cuflash on torch and on CuPy inputs, the torch adapter, and SDPA, forward alone
and forward + backward. Results: bench/results/probes/host-*.txt.

    python bench/host_overhead.py [--profile N]

--profile N: also where the host time goes, by cProfile, N lines each for cuflash.attention
and attention_backward on CuPy inputs and the torch adapter's forward + backward.
"""

import argparse
import cProfile
import pstats
import time

import cupy
import torch

import cuflash
import cuflash.torch


def per_call_us(fn, calls=300):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def profile(name, fn, lines, calls=200):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"== profile {name}, {calls} calls, by own time", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    q_cupy = cupy.from_dlpack(q.clone())
    q_grad = q.clone().requires_grad_()
    saved = cuflash.attention(q_cupy, q_cupy, q_cupy)
    cases = (
        ("cuflash.attention(torch)", lambda: cuflash.attention(q, q, q)),
        ("cuflash.attention(cupy)", lambda: cuflash.attention(q_cupy, q_cupy, q_cupy)),
        ("cuflash.attention_backward(cupy)", lambda: cuflash.attention_backward(q_cupy, q_cupy, q_cupy, q_cupy, *saved)),
        ("cuflash.torch.attention", lambda: cuflash.torch.attention(q, q, q)),
        ("cuflash.torch fwd+bwd", lambda: cuflash.torch.attention(q_grad, q_grad, q_grad).sum().backward()),
        ("sdpa", lambda: sdpa(q, q, q)),
        ("sdpa fwd+bwd", lambda: sdpa(q_grad, q_grad, q_grad).sum().backward()),
    )
    for name, fn in cases:
        print(f"host {name}: {per_call_us(fn):.1f} us/call", flush=True)
    if args.profile:
        for name, fn in cases:
            if name in ("cuflash.attention(cupy)", "cuflash.attention_backward(cupy)", "cuflash.torch fwd+bwd"):
                profile(name, fn, args.profile)


if __name__ == "__main__":
    main()
