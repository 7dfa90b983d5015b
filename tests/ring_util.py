"""Ring attention test helpers: the float64 reference as a ring's local attention, random
sharded problems, and the whole-sequence oracle (used by the CPU, GPU and torchrun tests)."""

from __future__ import annotations

import numpy as np
import torch

from cuflash import reference as ref
from cuflash.distributed import LocalAttention, SimulatedRing, ring_attention, shard_sequence, unshard_sequence


def _host64(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.float64 or t.device.type != "cpu":
        raise TypeError(f"the reference local attention takes float64 CPU tensors, got {t.dtype} on {t.device}")
    return t.detach().numpy()


def _reference_forward(q, k, v, causal, scale):
    out = ref.standard_attention(_host64(q), _host64(k), _host64(v), causal=causal, scale=scale)
    return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in out)


def _reference_backward(do, q, k, v, o, l, m, causal, scale):
    # Algorithm 4 takes the forward's o, l, m as given: with the ring's merged (global) ones it
    # returns the block's exact share of the gradients, as cuflash's backward does.
    grads = ref.flash_backward_tiled(*(_host64(t) for t in (do, q, k, v, o, l, m)), causal=causal, scale=scale)
    return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)


#: cuflash.reference (float64 NumPy) with the LocalAttention contract, for CPU rings.
REFERENCE_LOCAL = LocalAttention(_reference_forward, _reference_backward)


class RecordingLocal:
    """A LocalAttention wrapper that records every forward block as (Nq, Nk, causal)."""

    def __init__(self, inner: LocalAttention):
        self.inner = inner
        self.calls = []

    def forward(self, q, k, v, causal, scale):
        self.calls.append((q.shape[-2], k.shape[-2], causal))
        return self.inner.forward(q, k, v, causal, scale)

    def as_local(self) -> LocalAttention:
        return LocalAttention(self.forward, self.inner.backward)


def allowed_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs cuflash's (bottom-right aligned) causal mask allows in an nq x nk block."""
    return int(ref.allowed_keys(nq, nk, causal=causal).sum())


def random_problem(rng, batch, hq, hk, n, d, dv, dtype=np.float64):
    """q (B, Hq, N, d), k (B, Hk, N, d), v (B, Hk, N, dv), do like o: NumPy arrays in ``dtype``
    (values of that precision held in float32 for the 16-bit types, so torch can take them)."""
    shapes = ((batch, hq, n, d), (batch, hk, n, d), (batch, hk, n, dv), (batch, hq, n, dv))
    arrays = [rng.standard_normal(s) for s in shapes]
    if dtype in ("float16", "bfloat16"):
        arrays = [ref.round_to(a, dtype).astype(np.float32) for a in arrays]
    return arrays


def sharded(arrays, world_size, layout, *, dtype=torch.float64, device="cpu", requires_grad=False):
    """Per-rank lists of shards (torch tensors) of each whole-sequence array."""
    out = []
    for a in arrays:
        whole = torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
        shards = [s.contiguous() for s in shard_sequence(whole, world_size, layout)]
        out.append([s.requires_grad_(requires_grad) for s in shards])
    return out


def whole(shards, layout) -> np.ndarray:
    """The whole-sequence float64 NumPy array of per-rank shards."""
    return unshard_sequence([s.detach().to("cpu", torch.float64) for s in shards], layout).numpy()


def simulated_ring(qs, ks, vs, dos, world_size, layout, causal, *, local=None, between=None):
    """Forward with stats over a SimulatedRing, then backward through autograd with the
    sharded dO; ``between()`` runs after the forward (e.g. poisoning the cache). Whole-sequence
    results as float64 arrays: (o, (dq, dk, dv), (l, m))."""
    outs = ring_attention(qs, ks, vs, causal=causal, layout=layout, communicator=SimulatedRing(world_size),
                          return_stats=True, local_attention=local)
    assert len(outs) == world_size
    if between is not None:
        between()
    torch.autograd.backward([out.o for out in outs], dos)
    stats = tuple(whole([getattr(out, name)[..., None] for out in outs], layout)[..., 0] for name in "lm")
    grads = tuple(whole([t.grad for t in shards], layout) for shards in (qs, ks, vs))
    return whole([out.o for out in outs], layout), grads, stats


def max_err(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0.0))


def check_ring_result(o, grads, q, k, v, do, *, causal, dtype, stats=None):
    """A ring's whole-sequence o and (dq, dk, dv) (float64 NumPy) against the float64 reference.

    q, k, v, do: the whole-sequence inputs (NumPy, values of ``dtype``). float64: within 1e-12
    of the reference (rounding only). 16-bit: o within 2x, gradients within 3x the error of
    plain attention in ``dtype`` (the project's rule). stats: optional whole-sequence (l, m),
    compared as check_forward compares the kernels' (float64: 1e-12). Returns the errors (o, dq, dk, dv).
    """
    exact = ref.standard_attention(q, k, v, causal=causal)
    exact_grads = ref.standard_attention_backward(do, q, k, v, causal=causal)
    if dtype == "float64":
        bounds = [1e-12] * 4
    else:
        plain = ref.lowp_attention(q, k, v, dtype=dtype, causal=causal)
        plain_grads = ref.lowp_attention_backward(do, q, k, v, dtype=dtype, causal=causal)
        bounds = [2 * max_err(plain.o, exact.o) + 1e-6] + [3 * max_err(p, e) + 1e-6
                                                           for p, e in zip(plain_grads, exact_grads)]
    errors = []
    for name, got, want, bound in zip(("o", "dq", "dk", "dv"), (o, *grads), (exact.o, *exact_grads), bounds):
        assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
        assert not np.isnan(got).any(), f"NaN in {name}"
        err = max_err(got, want)
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} ({dtype})"
        errors.append(err)
    if stats is not None:
        # float32 statistics, as tests/gpu_util.py's check_forward holds the kernels to
        l_rtol, m_tol = (1e-12, 1e-12) if dtype == "float64" else (1e-4, 2e-5)
        np.testing.assert_allclose(stats[0], exact.l, rtol=l_rtol, err_msg="l")
        np.testing.assert_allclose(stats[1], exact.m, rtol=m_tol, atol=m_tol, err_msg="m")
    return errors


def poison_torch_cache(device, small_blocks=256, large_bytes=64 << 20):
    """Fill freed blocks of torch's caching allocator on ``device`` with 0xFF bytes (NaN in
    float16, bfloat16 and float32), so that tensors it hands out next -- the kernels' outputs
    -- start as NaN unless written. torch has no fill-on-allocate switch: this is the cache's
    free memory, poisoned, which later allocations of up to ``large_bytes`` are carved from."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    # 512 KiB requests come from the small-object pool (under 1 MiB), the last from the large one.
    held = [torch.empty(1 << 19, dtype=torch.uint8, device=device) for _ in range(small_blocks)]
    held.append(torch.empty(large_bytes, dtype=torch.uint8, device=device))
    for block in held:
        block.fill_(0xFF)
    del held
