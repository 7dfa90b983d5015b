"""Host time of one small attention call (1 x 1 x 128 x 64 bf16): cuflash on torch and CuPy inputs,
the torch adapter, and SDPA, forward and forward + backward. Results: bench/results/probes/host-*.txt."""
import time, torch, cupy, cuflash, cuflash.torch
F = torch.nn.functional.scaled_dot_product_attention
q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
qc = cupy.from_dlpack(q.clone())
qg = q.clone().requires_grad_()
cases = (("cuflash.attention(torch)", lambda: cuflash.attention(q, q, q)),
         ("cuflash.attention(cupy)", lambda: cuflash.attention(qc, qc, qc)),
         ("cuflash.torch.attention", lambda: cuflash.torch.attention(q, q, q)),
         ("cuflash.torch fwd+bwd", lambda: cuflash.torch.attention(qg, qg, qg).sum().backward()),
         ("sdpa", lambda: F(q, q, q)), ("sdpa fwd+bwd", lambda: F(qg, qg, qg).sum().backward()))
for name, fn in cases:
    for _ in range(30): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(300): fn()
    torch.cuda.synchronize(); print(f"host {name}: {(time.perf_counter() - t) / 300 * 1e6:.1f} us/call", flush=True)
