"""Where the host time of a call goes, on the GPU machine (session 7 diagnosis)."""
import cProfile
import pstats
import time

import cupy
import ml_dtypes
import torch

import cuflash
import cuflash.torch as ct


def per_call(fn, n=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * dt / n


shape = (1, 1, 128, 64)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
o, l, m = ct._forward_impl(q.detach(), k.detach(), v.detach(), False, None, None, None)
print("torch _forward_impl", per_call(lambda: ct._forward_impl(q, k, v, False, None, None, None)))
print("torch _backward_impl", per_call(lambda: ct._backward_impl(do, q, k, v, o, l, m, False, None, None, None, False)))
print("torch attention fwd (grad)", per_call(lambda: ct.attention(q, k, v)))
print("torch fwd+bwd(do)", per_call(lambda: ct.attention(q, k, v).backward(do)))
print("sdpa fwd+bwd(do)", per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(do)))
print("torch.empty x1", per_call(lambda: torch.empty(shape, device="cuda", dtype=torch.bfloat16)))
cq, ck, cv = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
print("cupy attention", per_call(lambda: cuflash.attention(cq, ck, cv)))
print("cupy.empty x1", per_call(lambda: cupy.empty(shape, dtype=cq.dtype)))
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    ct.attention(q, k, v).backward(do)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    cuflash.attention(cq, ck, cv)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(10)
