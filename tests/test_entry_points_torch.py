"""cuflash.torch.attention_varlen and cuflash.torch.attention_with_kvcache: bad boundaries
refused, naming the argument, on any device (torch alone); on a CUDA GPU, each against
cuflash.torch.attention's result (bit for bit) and the float64 reference, gradients too. Their
signatures and the calls they make are tested in test_entry_points.py.

Skipped without torch."""

import numpy as np
import pytest

from conftest import HAS_GPU
from cuflash import reference as ref
from entry_util import paged_problem
from gpu_util import OnHost

torch = pytest.importorskip("torch")

import cuflash.torch as ct  # noqa: E402  (after the importorskip)

gpu = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()), reason="needs torch with CUDA")
LENGTHS_Q = (1, 77, 0, 200)
LENGTHS_K = (5, 77, 3, 190)


def packed(rng, dtype, device, requires_grad=False):
    """(H, total, d) views of flash-attn's (total, H, d) tensors, their float64 host values and
    the int32 boundaries (on ``device`` and on the host)."""
    from varlen_util import packed_inputs

    host = packed_inputs(rng, "float32", LENGTHS_Q, LENGTHS_K, hq=4, hk=2, d=64)
    tensors = [torch.tensor(x).to(device, dtype).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(
        requires_grad) for x in host[:3]]
    values = [t.detach().double().cpu().numpy() for t in tensors]
    cus = [torch.tensor(c, device=device) for c in host[3:]]
    return tensors, values, cus, host[3:]


@pytest.mark.parametrize("which,bad,message", (
    ("cu_seqlens_q", lambda c: c.long(), r"cu_seqlens_q must be a 1-D int32 array .* got shape \(5,\), dtype int64"),
    ("cu_seqlens_k", lambda c: c[:, None], r"cu_seqlens_k must be a 1-D int32 array .* got shape \(5, 1\)"),
    ("cu_seqlens_q", lambda c: None, r"attention_varlen needs cu_seqlens_q, an int32 array .* got None"),
))
def test_bad_boundaries_are_refused_naming_them(which, bad, message, rng):
    """The boundaries' checks come before the device check: they run on CPU tensors too."""
    (q, k, v), _, cus, _ = packed(rng, torch.float16, "cpu")
    boundaries = dict(zip(("cu_seqlens_q", "cu_seqlens_k"), cus))
    boundaries[which] = bad(boundaries[which])
    with pytest.raises((TypeError, ValueError), match=message):
        ct.attention_varlen(q, k, v, *boundaries.values(), 200, 190)


# ---- on the GPU ------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_varlen_equals_attention_and_the_reference(dtype, causal, rng):
    from varlen_util import check_backward, check_forward

    (q, k, v), values, (cu_q, cu_k), host_cus = packed(rng, getattr(torch, dtype), "cuda", requires_grad=True)
    got = ct.attention_varlen(q, k, v, cu_q, cu_k, 200, 190, causal=causal, return_stats=True)
    rule = "float32" if dtype == "float32" else "bfloat16"
    check_forward([OnHost(x) for x in got], *values, *host_cus, dtype=rule, causal=causal)
    with torch.no_grad():
        want = ct.attention(q, k, v, causal=causal, return_stats=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=200, max_seqlen_k=190)
    rows = torch.tensor(ref.covered_rows(host_cus[0], q.shape[1]), device="cuda")
    for a, b in zip(got, want):
        assert torch.equal(a[:, rows], b[:, rows])
    do = torch.randn_like(got.o)
    got.o.backward(do)
    check_backward([OnHost(t.grad) for t in (q, k, v)], do.double().cpu().numpy(), *values, *host_cus, dtype=rule,
                   causal=causal)


def to_torch(x):
    """A host array (float16, bfloat16 or int32) as a CUDA tensor of its dtype."""
    if x.dtype.kind == "i":
        return torch.tensor(x, device="cuda")
    return torch.tensor(x.astype(np.float32)).to("cuda", getattr(torch, x.dtype.name))


@gpu
@pytest.mark.parametrize("num_splits", (1, 3, None))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_kvcache_paged_equals_attention_and_the_reference(dtype, num_splits, rng):
    from test_decode_gpu import check

    q, k, v, lengths, cache = paged_problem(rng, dtype)
    k_cache, v_cache = (to_torch(x) for x in cache.host_pages)
    options = dict(page_table=to_torch(cache.table), seqlens_k=to_torch(cache.lengths), num_splits=num_splits,
                   causal=True, return_stats=True)
    got = ct.attention_with_kvcache(to_torch(q), k_cache, v_cache, **options)
    check([OnHost(x) for x in got], q, k, v, lengths, dtype, causal=True)
    for a, b in zip(got, ct.attention(to_torch(q), k_cache, v_cache, **options)):
        assert torch.equal(a, b)


@gpu
def test_kvcache_dense_without_index_arrays_is_differentiable(rng):
    """No page table, lengths or split count: cuflash.torch.attention over the whole cache,
    which autograd records (the decoding arguments would be forward only)."""
    from gpu_util import check_backward, check_forward, random_array

    host = [random_array(rng, (2, h, n, 64), "bfloat16") for h, n in ((8, 3), (2, 300), (2, 300))]
    q, k, v = (to_torch(x).requires_grad_() for x in host)
    got = ct.attention_with_kvcache(q, k, v, causal=True, return_stats=True)
    check_forward([OnHost(x) for x in got], *host, causal=True, dtype="bfloat16")
    do = random_array(rng, got.o.shape, "bfloat16")
    got.o.backward(to_torch(do))
    check_backward([OnHost(t.grad) for t in (q, k, v)], do, *host, causal=True, dtype="bfloat16")
