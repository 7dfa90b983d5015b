"""cuflash.jax's decoding path without a GPU: what is decided at trace time (the plan, the
workspace outputs, the routing of short queries, every argument error, the refusal to be
differentiated), and the callback's plumbing run on JAX's CPU backend with a NumPy model of
the kernels in place of the launch (which buffers go where, the outputs coming back, jax.vmap).

The GPU tests of the kernels through the adapter are in test_jax_decode_gpu.py.
"""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from cpu_fakes import HostArrayAsDevice
from cuflash import _config, _decode, _spine, masks
from cuflash import reference as ref
from gpu_util import np_dtype, random_array
from test_decode_gpu import PagedCache, allowed_keys

jax = pytest.importorskip("jax")
jnp = jax.numpy
cj = pytest.importorskip("cuflash.jax")

BF16 = np.dtype(ml_dtypes.bfloat16)
S = jax.ShapeDtypeStruct


def meta(shape, dtype=BF16):
    """Row-major metadata of ``shape`` for _decode's host checks (one element of memory)."""
    dtype = np.dtype(dtype)
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape)))
    return HostArrayAsDevice(np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides), 0)


def callback_eqns(jaxpr):
    """The buffer_callback equations of a jaxpr, in every nested jaxpr too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "buffer_callback":
            yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from callback_eqns(inner)


def the_callback(fn, *specs):
    (eqn,) = callback_eqns(jax.make_jaxpr(fn)(*specs).jaxpr)
    return eqn


def path_of(eqn) -> str:
    name = eqn.params["callback"].__qualname__
    return "decode" if name.startswith("_decode_callback") else "fwd" if name.startswith("_forward_callback") else name


def paged(batch=4, hq=32, hk=8, nq=1, d=128, num_pages=40, page_size=64, max_pages=10, dtype=jnp.bfloat16):
    return (S((batch, hq, nq, d), dtype), S((num_pages, hk, page_size, d), dtype),
            S((num_pages, hk, page_size, d), dtype), S((batch, max_pages), jnp.int32), S((batch,), jnp.int32))


def decode(q, k, v, page_table=None, seqlens_k=None, **kwargs):
    return cj.attention(q, k, v, page_table=page_table, seqlens_k=seqlens_k, **kwargs)


# ---- trace time ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", (1, 4, None))
def test_plan_and_workspace_outputs_at_trace_time(num_splits):
    """The call's XLA outputs are o, l, m and, with more than one split, the splits' workspace
    (bytes), sized as plan_decode's plan sizes it (without a GPU: its H200 defaults)."""
    specs = paged()
    eqn = the_callback(lambda *a: decode(*a, num_splits=num_splits), *specs)
    q, k, _, table, lengths = specs
    plan = _decode.plan_decode(meta(q.shape), meta(k.shape), meta(k.shape), page_table=meta(table.shape, np.int32),
                               seqlens_k=meta(lengths.shape, np.int32), num_splits=num_splits)
    assert plan.num_splits == (num_splits or plan.num_splits) and (num_splits is not None or plan.num_splits > 1)
    avals = eqn.params["result_avals"]
    assert [a.shape for a in avals[:3]] == [q.shape, q.shape[:-1], q.shape[:-1]]
    assert [a.dtype for a in avals] == [q.dtype, np.float32, np.float32] + [np.uint8] * (len(avals) - 3)
    assert len(avals) == (3 if plan.num_splits == 1 else 4)
    assert plan.workspace_bytes == (0 if plan.num_splits == 1 else avals[3].shape[0]) and (
        plan.num_splits == 1 or plan.workspace_bytes >= 4 * plan.num_splits * plan.total_rows * (plan.dv + 2))
    assert eqn.params["vmap_method"] == "sequential"
    out = jax.eval_shape(lambda *a: decode(*a, num_splits=num_splits), *specs)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_dense_cache_with_and_without_lengths():
    q, k = S((3, 8, 2, 64), jnp.float16), S((3, 2, 1000, 64), jnp.float16)
    for lengths in (None, S((3,), jnp.int32)):
        eqn = the_callback(lambda q, k: decode(q, k, k, seqlens_k=lengths, num_splits=2), q, k)
        assert len(eqn.invars) == (3 if lengths is None else 4) and len(eqn.params["result_avals"]) == 4


def bad(message, exc=ValueError, **changes):
    return dict(changes=changes, exc=exc, message=message)


BAD_CALLS = {
    "lengths_dtype": bad(r"seqlens_k must be int32, got shape \(4,\), dtype int16", TypeError,
                         seqlens_k=S((4,), jnp.int16)),
    "table_dtype": bad("page_table must be int32", TypeError, page_table=S((4, 10), jnp.uint32)),
    "table_batch": bad(r"page_table must have shape \(batch, max_pages\) = \(4, >= 1\) .* got shape \(3, 10\)",
                       page_table=S((3, 10), jnp.int32)),
    "lengths_shape": bad(r"seqlens_k must have shape \(4,\), got shape \(4, 1\)", seqlens_k=S((4, 1), jnp.int32)),
    "no_lengths": bad("a paged cache needs seqlens_k", seqlens_k=None),
    "page_size": bad(r"page size \(k.shape\[2\]\) must be one of", k=S((40, 8, 48, 128), jnp.bfloat16),
                     v=S((40, 8, 48, 128), jnp.bfloat16)),
    "float32": bad("decoding takes float16 or bfloat16", TypeError, q=S((4, 32, 1, 128), jnp.float32),
                   k=S((40, 8, 64, 128), jnp.float32), v=S((40, 8, 64, 128), jnp.float32)),
    "dtypes_differ": bad("share one dtype", TypeError, q=S((4, 32, 1, 128), jnp.float16)),
    "queries": bad(r"decoding takes 1 to 16 queries a head, got q shape \(4, 32, 17, 128\)",
                   q=S((4, 32, 17, 128), jnp.bfloat16)),
    "head_dim": bad("decoding takes head dims up to 128", q=S((4, 32, 1, 256), jnp.bfloat16),
                    k=S((40, 8, 64, 256), jnp.bfloat16), v=S((40, 8, 64, 256), jnp.bfloat16)),
    "heads": bad("the k/v heads must divide the query heads", q=S((4, 12, 1, 128), jnp.bfloat16)),
    "scale": bad("scale must be finite and positive", scale=-1.0),
    "splits_zero": bad("num_splits must be between 1 and 256, got 0", num_splits=0),
    "splits_many": bad("num_splits must be between 1 and 256, got 300", num_splits=300),
    "splits_float": bad("num_splits must be an int or None, got 2.5", TypeError, num_splits=2.5),
    "splits_bool": bad("num_splits must be an int or None, got True", TypeError, num_splits=True),
    "table_list": bad("page_table must be an int32 array, got builtins.list", TypeError, page_table=[[0, 1]] * 4),
    "block_mask": bad("block_mask cannot be combined with page_table", block_mask=masks.dense(1)),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_arguments_fail_at_trace_time(name):
    case = BAD_CALLS[name]
    args = dict(zip(("q", "k", "v", "page_table", "seqlens_k"), paged()))
    args.update(case["changes"])
    arrays = {key: args.pop(key) for key in ("q", "k", "v")}
    with pytest.raises(case["exc"], match=case["message"]):
        jax.eval_shape(lambda q, k, v: cj.attention(q, k, v, **args), *arrays.values())


def test_differentiating_a_decoding_call_raises():
    q, k, v, table, lengths = paged()

    def loss(q, k, v):
        return decode(q, k, v, table, lengths).astype(jnp.float32).sum()

    for transform in (jax.grad(loss), jax.grad(loss, argnums=1), lambda q, k, v: jax.jvp(loss, (q, k, v), (q, k, v))):
        with pytest.raises(ValueError, match="split-KV decoding kernels, which are forward only"):
            jax.eval_shape(transform, q, k, v)
    # Inputs that carry no derivative are fine inside a differentiated function.
    frozen = jax.grad(lambda x, q, k, v: x * loss(jax.lax.stop_gradient(q), k, v))
    assert jax.eval_shape(frozen, S((), jnp.float32), q, k, v).shape == ()


# (q shape, k shape, dtype, block mask): the CuPy front end's _decode.routes_short_queries
# decides, and the adapter takes the same path.
ROUTING = {
    "decode_at_threshold": ((2, 8, 1, 128), (2, 2, _config.DECODE_MIN_KEYS, 128), BF16, None),
    "fwd_below_threshold": ((2, 8, 1, 128), (2, 2, _config.DECODE_MIN_KEYS - 1, 128), BF16, None),
    "decode_16_queries_mqa": ((3, 8, 16, 64), (3, 1, 1000, 64), np.float16, None),
    "fwd_17_queries": ((2, 8, 17, 128), (2, 2, 4096, 128), BF16, None),
    "fwd_float32": ((2, 8, 1, 128), (2, 2, 4096, 128), np.float32, None),
    "fwd_broadcast_batch": ((2, 8, 1, 128), (1, 2, 4096, 128), BF16, None),
    "fwd_head_dim_256": ((2, 8, 1, 256), (2, 2, 4096, 256), BF16, None),
    "fwd_block_mask": ((2, 8, 1, 128), (2, 2, 512, 128), BF16, masks.dense(1, n_k_blocks=4, block_size=128)),
    "decode_no_heads": ((4096, 1, 64), (4096, 4096, 64), BF16, None),  # 4096 "heads" of 1 query
}


@pytest.mark.parametrize("name", ROUTING)
def test_short_queries_take_the_path_cuflash_attention_takes(name):
    q_shape, k_shape, dtype, mask = ROUTING[name]
    expected = "decode" if _decode.routes_short_queries(meta(q_shape, dtype), meta(k_shape, dtype),
                                                          meta(k_shape, dtype), mask) else "fwd"
    assert expected == name.split("_")[0]
    q, k = S(q_shape, dtype), S(k_shape, dtype)
    eqn = the_callback(lambda q, k: cj.attention(q, k, k, block_mask=mask), q, k)
    assert path_of(eqn) == expected
    assert eqn.params["vmap_method"] == "expand_dims"
    # Routed or not, the call is differentiable: the usual backward takes its o, l, m.
    loss = lambda q, k: cj.attention(q, k, k, block_mask=mask).astype(jnp.float32).sum()  # noqa: E731
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1)), q, k)
    assert [g.shape for g in grads] == [q_shape, k_shape]


# ---- the callback on JAX's CPU backend, with a NumPy model of the kernels -----------------------


def host_view(ptr, shape, dtype, strides=None):
    """A NumPy view of host memory at ``ptr`` (the CPU backend's buffers): ``shape`` with
    element ``strides`` (default row-major)."""
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    memory = (ctypes.c_char * (extent * dtype.itemsize)).from_address(ptr)
    flat = np.frombuffer(memory, dtype=dtype, count=extent)
    return np.lib.stride_tricks.as_strided(flat, shape, tuple(st * dtype.itemsize for st in strides))


class KernelModel:
    """Stands in for the kernels' bound plans (_spine.bound_plan) and the forward's
    launch: reads the buffers as the kernels do, from raw pointers with the plan's shapes and
    strides, computes what the kernels compute in float64, writes it into the output buffers
    and records each launch."""

    def __init__(self):
        self.decodes, self.forwards = [], []

    def bound_plan(self, plan, device_id):
        model = self

        class Plan:
            workspace_bytes = plan.workspace_bytes

            def run(self, pointers, stream):
                model.run(plan, *pointers)

        return Plan()

    def run(self, plan, q, k, v, o, l, m, page_table, seqlens, workspace):
        f = plan.fields
        assert (workspace != 0) == (plan.combine is not None)
        if workspace:
            assert workspace not in (q, k, v, o, l, m), "the workspace is a buffer of its own"
            host_view(workspace, (plan.workspace_bytes,), np.uint8)[...] = 0xFF  # scratch: NaN, never read back
        self.decodes.append(dict(plan=plan, paged=page_table != 0))
        dtype = np_dtype(plan.variant.dtype)
        batch, hk, group, nq, cap = plan.batch, plan.kv_heads, plan.group, plan.nq, plan.capacity
        qh = host_view(q, (batch, hk, group, nq, plan.d), dtype, (f["q_batch_stride"], group * f["q_head_stride"],
                                                                  f["q_head_stride"], f["q_row_stride"], 1))
        qh = qh.reshape(batch, hk * group, nq, plan.d).astype(np.float64)
        if page_table == 0:
            rows = cap
            present = np.ones((batch, cap), bool)
        else:
            rows, table = 1 << f["page_shift"], host_view(page_table, (batch, f["max_pages"]), np.int32)
        kv = []
        for ptr, dim, name in ((k, plan.d, "k"), (v, plan.dv, "v")):
            strides = (f[f"{name}_batch_stride"], f[f"{name}_head_stride"], f[f"{name}_row_stride"], 1)
            lead = batch if page_table == 0 else f["num_pages"]
            kv.append(host_view(ptr, (lead, hk, rows, dim), dtype, strides).astype(np.float64))
        if page_table != 0:  # logical (batch, Hk, capacity, d) from the pages the table names
            entries = np.repeat(table, rows, axis=1)
            present = (entries >= 0) & (entries < f["num_pages"])
            slots, offsets = np.where(present, entries, 0), np.arange(cap) % rows
            kv = [x[slots, :, offsets].transpose(0, 2, 1, 3) for x in kv]
        lengths = [cap] * batch if seqlens == 0 else host_view(seqlens, (batch,), np.int32)
        # The kernels read no key past a length and none of a bad page (the tests' caches hold
        # NaN there): neither does the model.
        read = present & (np.arange(cap) < np.clip(lengths, 0, cap)[:, None])
        keys, values = (np.where(read[:, None, :, None], x, 0) for x in kv)
        window = (f["window_left"], f["window_right"])
        allowed = allowed_keys(lengths, nq, cap, window=None if window == (-1, -1) else window)
        exact = ref.standard_attention(qh, keys, values, scale=f["scale"], mask=allowed & present[:, None, None])
        host_view(o, plan.out_shape, dtype)[...] = exact.o.reshape(plan.out_shape).astype(dtype)
        host_view(l, plan.out_shape[:-1], np.float32)[...] = exact.l.reshape(plan.out_shape[:-1])
        host_view(m, plan.out_shape[:-1], np.float32)[...] = exact.m.reshape(plan.out_shape[:-1])

    def run_forward(self, ctx, outs, q, k, v, options):
        causal, scale, mask, window = options
        assert mask is None
        qh, kh, vh = (np.asarray(x).astype(np.float64) for x in (q, k, v))
        band = None if window is None else masks.sliding_window(qh.shape[-2], kh.shape[-2], *window)
        exact = ref.standard_attention(qh, kh, vh, causal=causal, scale=scale, mask=band)
        self.forwards.append(dict(q=qh.shape, k=kh.shape))
        for buf, value in zip(outs, exact):
            np.asarray(buf)[...] = value.astype(np.asarray(buf).dtype)


@pytest.fixture
def kernels(monkeypatch):
    """The adapter's callbacks on the CPU backend, launching into a KernelModel (on a machine
    with a GPU too: the model reads and writes the buffers as NumPy arrays, which only the CPU
    backend's are)."""
    model = KernelModel()
    from cuflash import _jax_calls

    monkeypatch.setattr(_jax_calls, "_pointer", lambda buf: np.asarray(buf).__array_interface__["data"][0])
    monkeypatch.setattr(_jax_calls, "_xla_stream", lambda ctx: 0)
    monkeypatch.setattr(_jax_calls, "_run_forward", model.run_forward)
    monkeypatch.setattr(_spine, "bound_plan", model.bound_plan)
    with jax.default_device(jax.devices("cpu")[0]):
        yield model


def expected_o(q, k, v, lengths, *, causal=False, window=None, scale=None):
    allowed = allowed_keys(lengths, q.shape[-2], k.shape[-2], causal=causal, window=window)
    return ref.standard_attention(q, k, v, scale=scale, mask=allowed).o


def assert_close(got, expected, dtype):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected.astype(dtype).astype(np.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_splits", (1, 3, None))
def test_dense_cache_buffers_and_outputs(kernels, num_splits, rng):
    lengths = np.array([0, 1, 17, 300], np.int32)
    q, k, v = (random_array(rng, (4, h, n, 64), "bfloat16") for h, n in ((8, 3), (2, 300), (2, 300)))
    step = jax.jit(lambda q, k, v, lengths: decode(q, k, v, seqlens_k=lengths, num_splits=num_splits, causal=True))
    o = step(q, k, v, lengths)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_close(o, expected_o(q, k, v, lengths, causal=True), q.dtype)
    (launch,) = kernels.decodes
    assert launch["plan"].out_shape == q.shape and launch["plan"].capacity == 300 and not launch["paged"]
    assert num_splits is None or launch["plan"].num_splits == num_splits
    # New lengths, same signature: the traced plan runs again, no new trace.
    longer = np.array([300, 299, 2, 1], np.int32)
    assert_close(step(q, k, v, longer), expected_o(q, k, v, longer, causal=True), q.dtype)
    assert len(kernels.decodes) == 2 and kernels.decodes[1]["plan"] is launch["plan"]
    assert step._cache_size() == 1


@pytest.mark.parametrize("page_size", (16, 64, 256))
def test_paged_cache_buffers_and_outputs(kernels, page_size, rng):
    lengths = [0, 5, page_size + 3, 4 * page_size]
    q, k, v = (random_array(rng, (4, h, n, 64), "float16") for h, n in ((4, 2), (1, 4 * page_size), (1, 4 * page_size)))
    cache = PagedCache(rng, k, v, lengths, page_size)
    o = jax.jit(lambda *a: decode(*a, window=(20, 0), num_splits=2))(q, *cache.host_pages, cache.table, cache.lengths)
    assert_close(o, expected_o(q, k, v, lengths, window=(20, 0)), q.dtype)
    assert kernels.decodes[0]["paged"] and kernels.decodes[0]["plan"].fields["num_pages"] == cache.num_pages


def test_vmap_of_a_decoding_call_runs_once_an_example(kernels, rng):
    lengths = np.array([[3, 300], [0, 250], [299, 1]], np.int32)
    q = random_array(rng, (3, 2, 4, 1, 64), "bfloat16")
    k, v = (random_array(rng, (2, 1, 300, 64), "bfloat16") for _ in range(2))
    o = jax.jit(jax.vmap(lambda q, n: decode(q, k, v, seqlens_k=n, num_splits=2)))(q, lengths)
    assert o.shape == q.shape
    for i in range(3):
        assert_close(o[i], expected_o(q[i], k, v, lengths[i]), q.dtype)
    assert [launch["plan"].out_shape for launch in kernels.decodes] == [q.shape[1:]] * 3


def test_routed_call_under_vmap(kernels, rng):
    """vmapped over every operand: one split-KV launch of the batched shapes with the traced
    split count; over q alone (k and v broadcast): the forward, which broadcasts."""
    nk = _config.DECODE_MIN_KEYS + 44
    q = random_array(rng, (3, 2, 8, 1, 64), "bfloat16")
    k, v = (random_array(rng, (3, 2, 2, nk, 64), "bfloat16") for _ in range(2))
    attend = lambda q, k, v: cj.attention(q, k, v, causal=True)  # noqa: E731
    traced = the_callback(attend, q[0], k[0], v[0])
    o = jax.jit(jax.vmap(attend))(q, k, v)
    for i in range(3):
        assert_close(o[i], expected_o(q[i], k[i], v[i], [nk] * 2, causal=True), q.dtype)
    (launch,) = kernels.decodes
    assert launch["plan"].out_shape == q.shape and launch["plan"].batch == 6
    splits = 1 if len(traced.params["result_avals"]) == 3 else launch["plan"].num_splits
    assert launch["plan"].num_splits == splits

    o = jax.jit(jax.vmap(attend, in_axes=(0, None, None)))(q, k[0], v[0])
    for i in range(3):
        assert_close(o[i], expected_o(q[i], k[0], v[0], [nk] * 2, causal=True), q.dtype)
    assert len(kernels.decodes) == 1 and kernels.forwards == [dict(q=q.shape, k=(1,) + k.shape[1:])]
