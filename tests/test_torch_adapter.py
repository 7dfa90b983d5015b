"""cuflash.torch: the differentiable PyTorch op against SDPA, opcheck, torch.compile.

Skipped without torch; everything but the meta-device shape test also needs a CUDA GPU.
Error bounds: the forward within 2x, gradients within 3x, of what plain attention in the same
dtype gets wrong against a float64 reference.
"""

import numpy as np
import pytest

from conftest import HAS_GPU
from cuflash import reference as ref

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cuflash.torch as ct  # noqa: E402  (after the importorskip)

gpu = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()), reason="needs torch with CUDA")

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

# (name, B, Hq, Hk, Nq, Nk, d, causal, layout): layout "bnhd" passes (B, N, H, d) buffers as
# (B, H, N, d) views, the way a model reshapes its projections.
CASES = (
    ("plain", 2, 4, 4, 256, 256, 64, False, "bhnd"),
    ("causal", 2, 4, 4, 200, 200, 128, True, "bhnd"),
    ("causal_rect", 1, 4, 4, 100, 230, 64, True, "bhnd"),
    ("gqa", 2, 6, 2, 77, 300, 64, False, "bnhd"),
    ("gqa_causal_rect", 2, 8, 2, 130, 257, 128, True, "bnhd"),
)
CASE_IDS = [c[0] for c in CASES]


def make(shape_bhnd, dtype, layout, requires_grad=False):
    b, h, n, d = shape_bhnd
    if layout == "bnhd":
        x = torch.randn(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    return x.requires_grad_(requires_grad)


def inputs(case, dtype, requires_grad=False):
    _, b, hq, hk, nq, nk, d, causal, layout = case
    q = make((b, hq, nq, d), dtype, layout, requires_grad)
    k = make((b, hk, nk, d), dtype, layout, requires_grad)
    v = make((b, hk, nk, d), dtype, layout, requires_grad)
    return q, k, v, causal


def sdpa(q, k, v, causal):
    """SDPA with cuflash's bottom-right causal mask (SDPA's is_causal is top-left aligned)."""
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[-3] != k.shape[-3])


def sdpa_math_lowp(q, k, v, causal):
    """SDPA's math backend computing in the inputs' dtype: plain attention as torch does it.

    (By default the math backend upcasts fp16/bf16 to fp32 and rounds only its output.)
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa(q, k, v, causal)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)


def host64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_sdpa(case, dtype):
    q, k, v, causal = inputs(case, TORCH_DTYPES[dtype])
    o = ct.attention(q, k, v, causal=causal)
    assert o.shape == sdpa(q, k, v, causal).shape and o.dtype == q.dtype and o.is_contiguous()
    exact = ref.standard_attention(host64(q), host64(k), host64(v), causal=causal)
    exact_o = torch.from_numpy(exact.o)
    err = max_err(o.cpu(), exact_o)
    err_math = max_err(sdpa_math_lowp(q, k, v, causal).cpu(), exact_o)
    # The NumPy model of plain attention in dtype, in case torch's math path is more exact.
    err_lowp = float(np.abs(ref.lowp_attention(host64(q), host64(k), host64(v), dtype=dtype,
                                               causal=causal).o - exact.o).max())
    bound = 2 * max(err_math, err_lowp) + 1e-6
    assert err <= bound, f"max |o - ref| {err:.3g} > {bound:.3g} (SDPA math {err_math:.3g}, lowp {err_lowp:.3g})"


@gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_sdpa(case, dtype):
    q, k, v, causal = inputs(case, TORCH_DTYPES[dtype], requires_grad=True)
    w = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype)

    def grads(fn, q, k, v):
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad_outputs=w.to(q.dtype))

    got = grads(lambda q, k, v, c: ct.attention(q, k, v, causal=c), q, k, v)
    exact = grads(sdpa, *(x.detach().double().requires_grad_() for x in (q, k, v)))
    own = grads(sdpa, q, k, v)  # torch's fused backend in dtype
    math = grads(sdpa_math_lowp, q, k, v)
    for name, g, e, o_, m_ in zip("qkv", got, exact, own, math):
        assert g.shape == e.shape and g.dtype == q.dtype
        err, baseline = max_err(g, e), max(max_err(o_, e), max_err(m_, e))
        bound = 3 * baseline + 1e-6
        assert err <= bound, f"d{name}: max err {err:.3g} > 3 x SDPA's {baseline:.3g}"


@gpu
def test_return_stats_and_stride0_gradient():
    q, k, v, causal = inputs(CASES[-1], torch.bfloat16, requires_grad=True)
    o, l, m = ct.attention(q, k, v, causal=causal, return_stats=True)
    assert l.dtype == m.dtype == torch.float32 and l.shape == m.shape == o.shape[:-1]
    assert o.requires_grad and not l.requires_grad and not m.requires_grad
    exact = ref.standard_attention(host64(q), host64(k), host64(v), causal=causal)
    np.testing.assert_allclose(host64(m), exact.m, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(host64(l), exact.l, rtol=1e-4)
    # o.sum()'s gradient is an expanded, stride-0 tensor: the op must copy it before the kernel.
    o.sum().backward()
    explicit = torch.autograd.grad(ct.attention(q, k, v, causal=causal), (q, k, v),
                                   grad_outputs=torch.ones_like(o))
    for g, e in zip((q.grad, k.grad, v.grad), explicit):
        assert max_err(g, e) <= 1e-2 * e.abs().max().item()


@gpu
def test_eager_backward_plans_follow_the_gradient_layout():
    """The eager backward finds its plan by dO's strides and dtype on the forward's plan: a
    contiguous, an expanded (copied first) and a transposed dO, in either order, give exactly
    the gradients of the same dO made contiguous (deterministic backward: bit for bit)."""
    q, k, v, causal = inputs(CASES[1], torch.bfloat16, requires_grad=True)
    base = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=torch.bfloat16)
    layouts = [base, base[:, :, :1, :1].expand(base.shape), base.transpose(1, 2).contiguous().transpose(1, 2)]
    torch.use_deterministic_algorithms(True)
    try:
        want = [torch.autograd.grad(ct.attention(q, k, v, causal=causal), (q, k, v), do.contiguous())
                for do in layouts]
        for order in ((0, 1, 2, 0, 2), (2, 1, 0, 1)):
            for i in order:
                got = torch.autograd.grad(ct.attention(q, k, v, causal=causal), (q, k, v), layouts[i])
                for g, w in zip(got, want[i]):
                    assert torch.equal(g, w), f"dO layout {i} (strides {layouts[i].stride()}) in order {order}"
    finally:
        torch.use_deterministic_algorithms(False)


@gpu
def test_runs_on_torch_current_stream():
    q0, k, v, causal = inputs(CASES[1], torch.float16)

    def run(q):
        q = q.detach().requires_grad_()
        o = ct.attention(q, k, v, causal=causal)
        (dq,) = torch.autograd.grad(o, (q,), grad_outputs=torch.ones_like(o))
        return o, dq

    expected, expected_dq = run(q0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = q0.clone().mul_(2).div_(2)  # exact; still queued on `side` when cuflash launches
        o, dq = run(q)
    side.synchronize()
    assert torch.equal(o, expected)
    assert max_err(dq, expected_dq) <= 1e-2 * expected_dq.abs().max().item()


@gpu
def test_deterministic_backward_follows_torch_flag():
    q, k, v, causal = inputs(CASES[3], torch.bfloat16, requires_grad=True)
    w = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(ct.attention(q, k, v, causal=causal), (q, k, v), grad_outputs=w)
                for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(previous)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bfloat16", "float32"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_opcheck(dtype, causal):
    q = make((2, 4, 48, 64), dtype, "bnhd", requires_grad=True)
    k = make((2, 2, 80, 64), dtype, "bhnd", requires_grad=True)
    v = make((2, 2, 80, 32), dtype, "bhnd", requires_grad=True)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, causal, None))
    with torch.no_grad():
        o, l, m = torch.ops.cuflash.attention_fwd(q, k, v, causal, 0.2)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), o, l, m, causal, 0.2))


class TinyAttention(torch.nn.Module):
    """One grouped-query causal self-attention block, projections in (B, N, H, d) layout."""

    def __init__(self, attend, dim=256, heads=4, kv_heads=2):
        super().__init__()
        self.attend, self.h, self.hk, self.dh = attend, heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.dh)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.hk, self.dh).unbind(2)
        o = self.attend(q, k.transpose(1, 2), v.transpose(1, 2))
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


@gpu
def test_compiled_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TinyAttention(lambda q, k, v: ct.attention(q, k, v, causal=True)).cuda()
    model = TinyAttention(lambda q, k, v: ct.attention(q, k, v, causal=True)).cuda()
    model.load_state_dict(eager.state_dict())
    baseline = TinyAttention(lambda q, k, v: sdpa(q, k, v, True)).cuda()
    baseline.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    for n in (128, 96):  # a second sequence length: recompiles with dynamic shapes
        x = torch.randn(2, n, 256, device="cuda")
        losses = []
        for net in (compiled, eager, baseline):
            loss = net(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
        assert abs(losses[0] - losses[2]) <= 1e-3 * abs(losses[2])
        for p, pe, pb in zip(model.parameters(), eager.parameters(), baseline.parameters()):
            assert torch.allclose(p.grad, pe.grad, rtol=1e-4, atol=1e-6)
            assert torch.allclose(p.grad, pb.grad, rtol=1e-2, atol=1e-4)
            pe.grad = pb.grad = None
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        eager.load_state_dict(model.state_dict())
        baseline.load_state_dict(model.state_dict())


def test_fake_shapes_on_meta_device():
    """Shape inference of both ops (their fake implementations) needs no GPU."""
    q = torch.empty(3, 1, 8, 10, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 30, 64, device="meta", dtype=torch.bfloat16)  # grouped heads
    v = torch.empty(1, 2, 30, 32, device="meta", dtype=torch.bfloat16)
    o, l, m = torch.ops.cuflash.attention_fwd(q, k, v, True, None)
    assert o.shape == (3, 2, 8, 10, 32) and o.dtype == torch.bfloat16
    assert l.shape == m.shape == (3, 2, 8, 10) and l.dtype == m.dtype == torch.float32
    dq, dk, dv = torch.ops.cuflash.attention_bwd(o, q, k, v, o, l, m, True, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # A permuted input still gets a contiguous gradient, as the CUDA implementation returns.
    qt = torch.empty(2, 10, 8, 64, device="meta").transpose(1, 2)
    o, l, m = torch.ops.cuflash.attention_fwd(qt, qt, qt, False, None)
    dq, _, _ = torch.ops.cuflash.attention_bwd(o, qt, qt, qt, o, l, m, False, None)
    assert dq.shape == qt.shape and dq.is_contiguous() and not qt.is_contiguous()


# ---- block masks and windows -----------------------------------------------------------------


def sparse_case(nq=300, nk=200, bs=(64, 32)):
    """A per-head random block mask (one head sees nothing) on (B, H, N, d) = (2, 4, ., 64)."""
    from cuflash import masks

    tq, tk = -(-nq // bs[0]), -(-nk // bs[1])
    blocks = np.random.default_rng(0).random((4, tq, tk)) < 0.4
    blocks[1] = False
    return masks.BlockMask.from_dense(blocks, bs), nq, nk


def masked_reference(q, k, v, w, mask, causal, window):
    args = [host64(x) for x in (q, k, v)]
    element = ref.element_mask(q.shape[-2], k.shape[-2], block_mask=mask, window=window)
    exact = ref.standard_attention(*args, causal=causal, mask=element)
    grads = ref.standard_attention_backward(host64(w), *args, causal=causal, mask=element)
    lowp = ref.lowp_attention(*args, dtype="bfloat16", causal=causal, mask=element)
    lowp_grads = ref.lowp_attention_backward(host64(w), *args, dtype="bfloat16", causal=causal, mask=element)
    return exact, grads, lowp, lowp_grads


@gpu
@pytest.mark.parametrize("causal,window", ((False, None), (True, None), (False, (40, 7)), (True, (-1, 0))))
def test_block_mask_forward_and_gradients(causal, window):
    mask, nq, nk = sparse_case()
    q = make((2, 4, nq, 64), torch.bfloat16, "bnhd", requires_grad=True)
    k = make((2, 2, nk, 64), torch.bfloat16, "bhnd", requires_grad=True)  # grouped heads
    v = make((2, 2, nk, 64), torch.bfloat16, "bhnd", requires_grad=True)
    w = torch.randn(2, 4, nq, 64, device="cuda", dtype=torch.bfloat16)
    o = ct.attention(q, k, v, causal=causal, block_mask=mask, window=window)
    got = torch.autograd.grad(o, (q, k, v), grad_outputs=w)
    exact, grads, lowp, lowp_grads = masked_reference(q, k, v, w, mask, causal, window)
    err, bound = np.abs(host64(o) - exact.o).max(), 2 * np.abs(lowp.o - exact.o).max() + 1e-6
    assert err <= bound, f"o: {err:.3g} > {bound:.3g}"
    assert (host64(o)[:, 1] == 0).all()  # the head with no block
    for name, g, e, p in zip("qkv", got, grads, lowp_grads):
        err, bound = np.abs(host64(g) - e).max(), 3 * np.abs(p - e).max() + 1e-6
        assert err <= bound, f"d{name}: {err:.3g} > {bound:.3g}"


@gpu
def test_block_mask_as_boolean_tensor_and_inline_mask():
    from cuflash import masks

    mask, nq, nk = sparse_case()
    q = make((2, 4, nq, 64), torch.float16, "bhnd", requires_grad=True)
    k = make((2, 4, nk, 64), torch.float16, "bhnd")
    blocks = torch.from_numpy(mask.to_dense()).cuda()
    expected = ct.attention(q, k, k, block_mask=mask)
    assert torch.equal(ct.attention(q, k, k, block_mask=blocks, block_size=(64, 32)), expected)
    # A mask made inline for one call lives until the backward pass has used it.
    o = ct.attention(q, k, k, block_mask=masks.BlockMask.from_dense(mask.to_dense(), (64, 32)))
    import gc

    gc.collect()
    # The deterministic backward, so that the two gradients can be compared bit for bit: the
    # atomic one adds dQ's pieces in whichever order the CTAs finish.
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        (dq,) = torch.autograd.grad(o, (q,), grad_outputs=torch.ones_like(o))
        (expected_dq,) = torch.autograd.grad(expected, (q,), grad_outputs=torch.ones_like(o))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(dq, expected_dq)


@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bfloat16", "float32"))
def test_opcheck_with_block_mask(dtype):
    mask, nq, nk = sparse_case(100, 80, (32, 16))
    q = make((2, 4, nq, 64), dtype, "bnhd", requires_grad=True)
    k = make((2, 4, nk, 64), dtype, "bhnd", requires_grad=True)
    v = make((2, 4, nk, 32), dtype, "bhnd", requires_grad=True)
    args = (q, k, v, True, None, mask.token, 30, 2)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args)
    with torch.no_grad():
        o, l, m = torch.ops.cuflash.attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), o, l, m) + args[3:])


@gpu
def test_compiled_training_step_with_block_mask():
    from cuflash import masks

    torch._dynamo.reset()
    torch.manual_seed(0)
    mask = masks.local(2, 1, block_size=64) | masks.global_tokens(2, 1, block_size=64)

    def attend(q, k, v):
        return ct.attention(q, k, v, causal=True, block_mask=mask, window=(70, 0))

    eager = TinyAttention(attend).cuda()
    model = TinyAttention(attend).cuda()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 128, 256, device="cuda")
    losses = []
    for net in (compiled, eager):
        loss = net(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    for p, pe in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, pe.grad, rtol=1e-4, atol=1e-6)


def test_fake_shapes_with_block_mask_on_meta_device():
    mask, nq, nk = sparse_case()
    q = torch.empty(2, 4, nq, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, nk, 64, device="meta", dtype=torch.bfloat16)
    o, l, m = torch.ops.cuflash.attention_fwd(q, k, k, True, None, mask.token, 10, -1)
    assert o.shape == (2, 4, nq, 64) and l.shape == (2, 4, nq)
    dq, dk, dv = torch.ops.cuflash.attention_bwd(o, q, k, k, o, l, m, True, None, mask.token, 10, -1)
    assert (dq.shape, dk.shape) == (q.shape, k.shape)


def test_compile_passes_the_mask_as_a_token():
    """torch.compile(fullgraph=True) traces the adapter with a BlockMask and a window into the
    forward and backward graphs (on the meta device: the operators' fake implementations)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm.code)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch._dynamo.reset()
    mask, nq, nk = sparse_case()
    other, _, _ = sparse_case()

    @torch.compile(fullgraph=True, backend=backend)
    def loss(q, k, v, mask):
        return ct.attention(q, k, v, causal=True, block_mask=mask, window=(33, 4)).float().sum()

    for m in (mask, other):
        q = torch.empty(2, 4, nq, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 2, nk, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        dq, dk, _ = torch.autograd.grad(loss(q, k, k, m), (q, k, k))
        assert dq.shape == q.shape and dk.shape == k.shape
    # The first graphs have the first mask's token baked in; after a second mask, the token
    # becomes a graph input (an int), so further masks reuse the graph.
    assert f"attention_fwd.default(primals_1, primals_2, primals_2, True, None, {mask.token}, 33, 4)" in graphs["forward"][0]
    assert f"True, None, {mask.token}, 33, 4)" in graphs["backward"][0]
    assert "attention_bwd.default(" in graphs["backward"][-1] and "33, 4)" in graphs["backward"][-1]
    assert len(graphs["forward"]) == 2
    with pytest.raises(TypeError, match="boolean array"):
        ct.attention(q, k, k, block_mask="not a mask")


@gpu
@pytest.mark.parametrize("grad", (False, True))
def test_short_queries_take_the_split_kv_path_without_autograd(grad):
    """Outside autograd, 1-16 queries a head against at least _config.DECODE_MIN_KEYS keys run on
    the split-KV decoding kernels, as cuflash.attention routes them; a call autograd records
    keeps the forward (its backward needs nothing else, but the route is decided per path).
    Both give the reference's o, l and m."""
    from cuflash import _config
    from gpu_util import launched_variants

    nk = 2 * _config.DECODE_MIN_KEYS + 17
    q = torch.randn(2, 8, 3, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
    k, v = (torch.randn(2, 2, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with launched_variants() as launched:
        o, l, m = ct.attention(q, k, v, causal=True, return_stats=True)
    expected = "fwd" if grad else "decode"
    assert launched and launched[0].key.startswith(expected + "_"), [x.key for x in launched]
    exact = ref.standard_attention(host64(q), host64(k), host64(v), causal=True)
    lowp = sdpa_math_lowp(q.detach(), k, v, True)
    bound = 2 * max_err(lowp, torch.from_numpy(exact.o).to(lowp.device)) + 1e-6
    assert max_err(o, torch.from_numpy(exact.o).to(o.device)) <= bound
    np.testing.assert_allclose(host64(m), exact.m, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(host64(l), exact.l, rtol=1e-4)
