"""CUDA graphs: cuflash under CuPy stream capture, torch.cuda.graph and
torch.compile(mode="reduce-overhead"); replays give bit-identical results to eager calls.
Also the launch plans' pointer rebinding: one plan serving calls on fresh buffers."""

import numpy as np
import pytest

from conftest import HAS_GPU, requires_gpu
from cuflash import reference as ref


def _rand(cupy, shape, dtype, seed):
    import ml_dtypes

    rng = cupy.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@requires_gpu
def test_one_plan_serves_fresh_buffers_correctly():
    """Every call after the first reuses the signature's plan with other pointers (and, on
    Hopper, tensor maps re-addressed): each result is checked against the reference."""
    import cupy

    import cuflash
    from cuflash import _spine

    shape = (2, 4, 300, 64)
    for seed in range(4):
        q, k, v = (_rand(cupy, shape, "bfloat16", 10 * seed + i) for i in range(3))
        o, l, m = cuflash.attention(q, k, v, causal=True)
        want = ref.standard_attention(*(x.astype(cupy.float32).get().astype(np.float64) for x in (q, k, v)),
                                      causal=True)
        err = np.abs(o.astype(cupy.float32).get() - want.o).max()
        assert err < 2e-2, (seed, err)
        np.testing.assert_allclose(m.get(), want.m, rtol=1e-2, atol=1e-2)
    forward, _ = _spine.plan_counts()
    assert forward >= 1


@requires_gpu
def test_cupy_stream_capture_replays_bit_identical():
    import cupy

    import cuflash

    shape = (2, 4, 256, 64)
    q, k, v, do = (_rand(cupy, shape, "float16", i) for i in range(4))
    cupy.cuda.Device().synchronize()  # made on the null stream, which a non-blocking stream does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cuflash.attention(q, k, v, causal=True)
        grads = cuflash.attention_backward(do, q, k, v, *out, causal=True, deterministic=True)
        eager = [x.copy() for x in (*out, *grads)]
        del out, grads  # their blocks go back to the pool, for the capture to take
        stream.synchronize()
        stream.begin_capture()
        out = cuflash.attention(q, k, v, causal=True)
        grads = cuflash.attention_backward(do, q, k, v, *out, causal=True, deterministic=True)
        graph = stream.end_capture()
        for x in (*out, *grads):
            x.fill(np.nan)  # poisoned: only the replay writes them
        graph.launch(stream)
        stream.synchronize()
    for got, want in zip((*out, *grads), eager):
        assert cupy.array_equal(got, want)
    # new inputs in the same buffers: the replay computes on them
    q[...] = _rand(cupy, shape, "float16", 99)
    with stream:
        graph.launch(stream)
        fresh = cuflash.attention(q, k, v, causal=True)
        stream.synchronize()
    assert cupy.array_equal(out.o, fresh.o)


torch_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def _torch_inputs(torch, shape, seed, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(requires_grad)
            for _ in range(3)]


def _warm_up_for_capture(torch, step):
    """Run ``step`` twice on a side stream, as torch.cuda.graph capture wants: plans, kernels and
    allocator blocks exist before capture begins."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)


@torch_gpu
def test_torch_cuda_graph_replays_forward_and_backward_bit_identical():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    shape = (2, 4, 256, 64)
    q, k, v = _torch_inputs(torch, shape, 0)
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True)
    try:
        def step():
            for x in (q, k, v):
                x.grad = None
            out = ct.attention(q, k, v, causal=True)
            out.backward(do)
            return out

        _warm_up_for_capture(torch, step)
        eager = step().detach().clone()
        eager_grads = [x.grad.clone() for x in (q, k, v)]
        graph = torch.cuda.CUDAGraph()
        for x in (q, k, v):
            x.grad = None
        with torch.cuda.graph(graph):
            out = ct.attention(q, k, v, causal=True)
            out.backward(do)
        for x in (out, q.grad, k.grad, v.grad):
            x.data.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        for x, want in zip((q, k, v), eager_grads):
            assert torch.equal(x.grad, want)
    finally:
        torch.use_deterministic_algorithms(False)


@torch_gpu
def test_torch_compile_reduce_overhead_matches_eager():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    shape = (2, 4, 128, 64)

    def attend(q, k, v):
        return ct.attention(q, k, v, causal=True)

    compiled = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    torch.use_deterministic_algorithms(True)
    try:
        for seed in range(3):  # the first calls record the graph, the last replays it
            q, k, v = _torch_inputs(torch, shape, seed)
            do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            want = attend(q, k, v)
            want_grads = torch.autograd.grad(want, (q, k, v), do)
            got = compiled(q, k, v)
            got_grads = [g.clone() for g in torch.autograd.grad(got, (q, k, v), do)]
            assert torch.equal(got.clone(), want)
            for a, b in zip(got_grads, want_grads):
                assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(False)


@torch_gpu
def test_torch_eager_calls_skip_the_dispatcher_and_build_no_plan_twice():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    from cuflash import _spine

    shape = (1, 2, 64, 64)
    q, k, v = _torch_inputs(torch, shape, 1)
    ct.attention(q, k, v).sum().backward()
    before = _spine.plan_counts()
    for seed in range(3):
        q, k, v = _torch_inputs(torch, shape, seed + 5)
        ct.attention(q, k, v).sum().backward()
    assert _spine.plan_counts() == before


@torch_gpu
def test_torch_decode_step_captured_in_a_cuda_graph():
    """A decode step (paged cache, lengths in device memory) captured once and replayed: bit-
    identical to eager calls, and a replay after the lengths and the query change in place
    computes the new step."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    batch, hq, hk, d, page, num_pages, max_pages = 4, 8, 2, 128, 64, 80, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    k_cache, v_cache = (torch.randn(num_pages, hk, page, d, device="cuda", dtype=torch.bfloat16, generator=g)
                        for _ in range(2))
    page_table = torch.randperm(num_pages, device="cuda", generator=g)[:batch * max_pages].view(batch, max_pages)
    page_table = page_table.to(torch.int32).contiguous()
    seqlens = torch.tensor([1, 100, 640, 1024], device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        return ct.attention(q, k_cache, v_cache, page_table=page_table, seqlens_k=seqlens, return_stats=True)

    _warm_up_for_capture(torch, step)
    eager = [x.clone() for x in step()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for x in out:
        x.fill_(float("nan"))
    graph.replay()
    for got, want in zip(out, eager):
        assert torch.equal(got, want)
    seqlens.copy_(torch.tensor([7, 1000, 3, 512], device="cuda", dtype=torch.int32))
    q.copy_(torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    fresh = step()
    for got, want in zip(out, fresh):
        assert torch.equal(got, want)
