"""Quick host-time probe (session 7, first GPU call): CPU us per call with the queue full."""
import time

import numpy as np


def per_call(fn, n=2000, warm=50, sync=None):
    for _ in range(warm):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t
    sync()
    return 1e6 * elapsed / n


def main():
    import cupy
    import ml_dtypes
    import torch
    import torch.nn.functional as F

    import cuflash
    import cuflash.torch as ct

    rows = []
    shape = (1, 1, 128, 64)
    q, k, v, do = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16) for _ in range(4))
    sync = cupy.cuda.Device().synchronize
    o, l, m = cuflash.attention(q, k, v)
    rows.append(("cupy fwd", per_call(lambda: cuflash.attention(q, k, v), sync=sync)))
    rows.append(("cupy bwd", per_call(lambda: cuflash.attention_backward(do, q, k, v, o, l, m), sync=sync)))
    tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    tsync = torch.cuda.synchronize
    with torch.no_grad():
        rows.append(("torch fwd (no grad)", per_call(lambda: ct.attention(tq, tk, tv), sync=tsync)))
        rows.append(("sdpa fwd (no grad)", per_call(lambda: F.scaled_dot_product_attention(tq, tk, tv), sync=tsync)))

    def fb(f):
        def run():
            f(tq, tk, tv).sum().backward()
        return run
    rows.append(("torch fwd+bwd", per_call(fb(ct.attention), n=1000, sync=tsync)))
    rows.append(("sdpa fwd+bwd", per_call(fb(F.scaled_dot_product_attention), n=1000, sync=tsync)))
    for name, us in rows:
        print(f"host {name:22s} {us:8.1f} us/call")

    for (b, h, n, d) in ((8, 12, 1024, 64), (32, 12, 256, 64), (4, 32, 2048, 128), (1, 32, 8192, 128)):
        xs = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        g = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        out = {}
        for name, f in (("cuflash", lambda a, bb, c: ct.attention(a, bb, c, causal=True)),
                        ("sdpa", lambda a, bb, c: F.scaled_dot_product_attention(a, bb, c, is_causal=True))):
            def step():
                f(*xs).backward(g)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                step()
            e.record()
            torch.cuda.synchronize()
            out[name] = s.elapsed_time(e) / 20
        print(f"e2e {b}x{h}x{n}x{d} causal fwd+bwd: cuflash {out['cuflash']:.3f} ms sdpa {out['sdpa']:.3f} ms "
              f"ratio {out['sdpa'] / out['cuflash']:.2f}x")

    try:
        import jax
        import jax.numpy as jnp

        import cuflash.jax as cj
        jq = jax.random.normal(jax.random.key(0), (1, 128, 1, 64), dtype=jnp.bfloat16)
        ours = jax.jit(lambda a: cj.attention(a.transpose(0, 2, 1, 3), a.transpose(0, 2, 1, 3), a.transpose(0, 2, 1, 3)))
        theirs = jax.jit(lambda a: jax.nn.dot_product_attention(a, a, a, implementation="cudnn"))
        gours = jax.jit(jax.grad(lambda a: ours(a).astype(jnp.float32).sum()))
        gtheirs = jax.jit(jax.grad(lambda a: theirs(a).astype(jnp.float32).sum()))
        for name, f in (("jax cuflash fwd", ours), ("jax cudnn fwd", theirs), ("jax cuflash grad", gours),
                        ("jax cudnn grad", gtheirs)):
            f(jq).block_until_ready()
            t = time.perf_counter()
            for _ in range(500):
                r = f(jq)
            r.block_until_ready()
            print(f"host {name:22s} {1e6 * (time.perf_counter() - t) / 500:8.1f} us/call")
    except Exception as exc:  # noqa
        print("jax:", type(exc).__name__, exc)


if __name__ == "__main__":
    main()
