"""Hardening (GPU; skipped without one): extreme logits, inf and NaN inputs, rows without keys,
one query or key, more than 2^31 elements, threads on first use, streams, devices, aliasing.

What NaN does (read off kernels/flash_fwd.cu and flash_fwd_f32.cu, and pinned down here):
    * NaN in q[i]: row i of o is NaN; nothing else changes.
    * NaN in k[j]: every row that may attend key j is NaN (its score is NaN, and the P = exp
      of it enters l and every column of o). Rows that may not attend j get -inf for that
      score before the softmax and are bit for bit what they would be without the NaN.
    * NaN in v[j, c]: column c of every row that attends j is NaN. Rows that do not attend j
      but whose query tile loads j's key tile get 0 * NaN = NaN in column c too (the P V
      product runs over whole tiles); rows whose tile never loads it, other columns and other
      (batch, head) slices are unchanged.
A score of +inf (inf in k, q . k > 0) makes its row NaN, as in the float64 reference; a score
of -inf is a masked key.
"""

import collections
import concurrent.futures
import threading

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import reference as ref
from gpu_util import DTYPES, check_backward, check_forward, np_dtype, random_array, to_device, to_host64

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]


def forward(q, k, v, **kwargs):
    import cuflash

    return cuflash.attention(to_device(q), to_device(k), to_device(v), **kwargs)


def forward_backward(q, k, v, do, *, deterministic=False, **kwargs):
    import cuflash

    q_d, k_d, v_d = (to_device(x) for x in (q, k, v))
    out = cuflash.attention(q_d, k_d, v_d, **kwargs)
    grads = cuflash.attention_backward(to_device(do), q_d, k_d, v_d, *out, deterministic=deterministic, **kwargs)
    return out, grads


def bits(x):
    """A device or host array as host unsigned integers of its width, for bit-exact comparison."""
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


# ---- extreme logits --------------------------------------------------------------------------

def integer_operands(rng, shape, sign):
    """Integers of magnitude 1..3 (exact in every dtype) with the given sign, or random signs.

    Their products are integers, so distinct scores differ by at least the scale: with scores
    scaled to +-1e4 the softmax is exactly one-hot, or uniform over exact ties, with no
    near-ties on which fp32 rounding of the scores (1e-3 at 1e4) would move the weights.
    """
    x = rng.integers(1, 4, size=shape).astype(np.float32)
    if sign == "mixed":
        x *= rng.choice(np.float32([-1, 1]), size=shape)
    return -x if sign == "negative" else x


@pytest.mark.parametrize("signs", ("mixed", "positive", "negative"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_of_1e4_do_not_overflow(dtype, signs, rng):
    """exp(1e4) overflows and exp(-1e4) underflows to 0 for the whole row: only the running
    max keeps the softmax finite. Forward within the usual rule; backward finite and close."""
    q = integer_operands(rng, (2, 2, 100, 64), "mixed" if signs == "mixed" else "positive")
    k = integer_operands(rng, (2, 2, 130, 64), signs)
    scale = 1e4 / np.abs(q @ k.swapaxes(-1, -2)).max()
    q, k = q.astype(np_dtype(dtype)), k.astype(np_dtype(dtype))
    v = random_array(rng, (2, 2, 130, 64), dtype)
    do = random_array(rng, (2, 2, 100, 64), dtype)
    for causal in (False, True):
        out, grads = forward_backward(q, k, v, do, causal=causal, scale=scale)
        check_forward(out, q, k, v, causal=causal, scale=scale, dtype=dtype)
        # P is exact here (integer scores, exact exponents), so what remains is the term every
        # flash backward carries: D = rowsum(dO * O) reads o rounded to dtype. On a one-hot row
        # the exact dS is 0 and that rounding is all of it, scaled by scale ~ 17 into dQ and dK.
        # Bound: twice that term, computed in float64, plus 1 % of the gradients' scale.
        # (Plain attention in dtype is no yardstick here: it rounds 1e4-sized logits to bf16.)
        exact = ref.standard_attention_backward(do, q, k, v, causal=causal, scale=scale)
        shifts = d_rounding_shift(do, q, k, v, causal=causal, scale=scale, dtype=dtype)
        dv_scale = np.abs(exact[2]).max()
        for name, g, e, shift in zip(("dq", "dk", "dv"), grads, exact, shifts):
            g = to_host64(g)
            err = np.abs(g - e).max()
            bound = 1e-2 * max(np.abs(e).max(), dv_scale) + 2 * np.abs(shift).max()
            assert np.isfinite(g).all(), f"{name} is not finite"
            assert err <= bound, f"{name} off by {err:.3g} > {bound:.3g}"


def d_rounding_shift(do, q, k, v, *, causal, scale, dtype):
    """How far (dq, dk, dv) move, in float64, when D = rowsum(dO * O) uses O rounded to dtype.

    dS = P (dP - D) gains -P dD, so dQ gains -scale (P dD) K and dK gains -scale (P dD)^T Q.
    P comes from the reference run on V = identity (its o is then P itself)."""
    q64, k64, do64 = (np.asarray(x, dtype=np.float64) for x in (q, k, do))
    nk = k64.shape[-2]
    eye = np.broadcast_to(np.eye(nk), k64.shape[:-2] + (nk, nk))
    p = ref.standard_attention(q64, k64, eye, causal=causal, scale=scale).o
    o = ref.standard_attention(q64, k64, np.asarray(v, dtype=np.float64), causal=causal, scale=scale).o
    d_shift = np.sum(do64 * (ref.round_to(o, dtype).astype(np.float64) - o), axis=-1)
    weighted = p * d_shift[..., None]
    return -scale * weighted @ k64, -scale * weighted.swapaxes(-1, -2) @ q64, np.zeros_like(o[..., :1])


# ---- NaN and inf -----------------------------------------------------------------------------

NAN_SLICE = (1, 2)  # the (batch, head) slice that gets the NaN; the other five stay clean


def nan_problem(rng, dtype, nq, nk):
    return [random_array(rng, (2, 3, n, 64), dtype) for n in (nq, nk, nk)]


def with_value(x, index, value):
    x = x.copy()
    x[index] = value
    return x


def assert_unchanged_outside(dirty, clean, touched):
    """o, l, m of two runs are bit-identical except where ``touched`` (over o's shape) is set."""
    o_touched = touched
    row_touched = touched.any(axis=-1)
    for name, got, want, where in (("o", dirty.o, clean.o, o_touched), ("l", dirty.l, clean.l, row_touched),
                                   ("m", dirty.m, clean.m, row_touched)):
        np.testing.assert_array_equal(bits(got)[~where], bits(want)[~where], err_msg=f"{name} changed")


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_a_key_reaches_exactly_the_rows_that_attend_it(dtype, causal, rng):
    nq, nk, j = 150, 200, 120
    q, k, v = nan_problem(rng, dtype, nq, nk)
    clean = forward(q, k, v, causal=causal)
    dirty = forward(q, with_value(k, NAN_SLICE + (j, 5), np.nan), v, causal=causal)
    attends = ref.allowed_keys(nq, nk, causal=causal)[:, j]
    assert np.isnan(to_host64(dirty.o)[NAN_SLICE][attends]).all(), "a row attending key j is not all NaN"
    touched = np.zeros(clean.o.shape, bool)
    touched[NAN_SLICE][attends] = True
    assert_unchanged_outside(dirty, clean, touched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_a_query_reaches_only_its_row(dtype, rng):
    q, k, v = nan_problem(rng, dtype, 150, 200)
    for causal in (False, True):
        clean = forward(q, k, v, causal=causal)
        dirty = forward(with_value(q, NAN_SLICE + (77, 9), np.nan), k, v, causal=causal)
        assert np.isnan(to_host64(dirty.o)[NAN_SLICE][77]).all()
        touched = np.zeros(clean.o.shape, bool)
        touched[NAN_SLICE + (77,)] = True
        assert_unchanged_outside(dirty, clean, touched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_a_value_stays_in_its_column_and_the_tiles_that_load_it(dtype, rng):
    from cuflash import _config

    n, j, col = 1024, 1000, 5
    q, k, v = nan_problem(rng, dtype, n, n)
    clean = forward(q, k, v, causal=True)
    dirty = forward(q, k, with_value(v, NAN_SLICE + (j, col), np.nan), causal=True)
    variant = _config.forward_config(dtype, 64, 64, True)
    # A CTA of block_rows queries loads the key tiles up to its last query (Nq = Nk): rows in
    # CTAs that end at or before the start of j's key tile never see v[j].
    unreached = (j // variant.block_cols * variant.block_cols) // variant.block_rows * variant.block_rows
    assert unreached > 0
    o = to_host64(dirty.o)[NAN_SLICE]
    assert np.isnan(o[j:, col]).all(), "a row attending key j has a number in column c"
    assert np.isfinite(np.delete(o, col, axis=-1)).all(), "NaN outside column c"
    touched = np.zeros(clean.o.shape, bool)
    touched[NAN_SLICE + (slice(unreached, None), col)] = True
    assert_unchanged_outside(dirty, clean, touched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_in_a_key_is_nan_for_positive_scores_and_masked_for_negative(dtype, rng):
    """Non-causal, so that a subset of rows is a problem of its own for check_forward."""
    import cuflash

    nq, nk, j, c = 150, 200, 120, 7
    q, k, v = nan_problem(rng, dtype, nq, nk)
    q[..., c] = np.where(q[..., c] == 0, 1, q[..., c])  # 0 * inf would be NaN for any sign
    clean = forward(q, k, v)
    k_inf = with_value(k, NAN_SLICE + (j, c), np.inf)
    dirty = forward(q, k_inf, v)
    positive = q[NAN_SLICE][:, c].astype(np.float64) > 0
    o = to_host64(dirty.o)[NAN_SLICE]
    assert np.isnan(o[positive]).all() and np.isfinite(o[~positive]).all()
    masked = np.flatnonzero(~positive)
    rows = cuflash.AttentionOutput(*(x[NAN_SLICE][masked] for x in dirty))
    check_forward(rows, q[NAN_SLICE][masked], k_inf[NAN_SLICE], v[NAN_SLICE], causal=False, dtype=dtype)
    touched = np.zeros(clean.o.shape, bool)
    touched[NAN_SLICE] = True
    assert_unchanged_outside(dirty, clean, touched)


# ---- rows without keys, tiny problems --------------------------------------------------------

@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_keys_give_zero_output_and_gradients(dtype, deterministic, rng):
    nq, nk = 200, 60  # causal, bottom-right aligned: rows 0..139 see no key
    q, k, v, do = (random_array(rng, (2, 2, n, 64), dtype) for n in (nq, nk, nk, nq))
    out, grads = forward_backward(q, k, v, do, causal=True, deterministic=deterministic)
    o, l, m, dq = (to_host64(x) for x in (*out, grads.dq))
    empty = slice(0, nq - nk)
    assert (o[..., empty, :] == 0).all() and (l[..., empty] == 0).all() and np.isneginf(m[..., empty]).all()
    assert (dq[..., empty, :] == 0).all()
    check_forward(out, q, k, v, causal=True, dtype=dtype)
    check_backward(grads, do, q, k, v, causal=True, dtype=dtype)


@pytest.mark.parametrize("nq,nk", ((1, 1), (1, 7), (7, 1)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_query_or_one_key_with_head_dim_8(dtype, nq, nk, rng):
    # 64 heads: with 3 (24 entries of dQ at one query) the max error of plain attention, the
    # bound's yardstick, was itself small by chance often enough to fail the 3x rule (0.0071
    # against 3 x 0.00187 once at 6c55a17).
    q, k, v, do = (random_array(rng, (64, n, 8), dtype) for n in (nq, nk, nk, nq))
    for causal in (False, True):
        for deterministic in (False, True):
            out, grads = forward_backward(q, k, v, do, causal=causal, deterministic=deterministic)
            check_forward(out, q, k, v, causal=causal, dtype=dtype)
            check_backward(grads, do, q, k, v, causal=causal, dtype=dtype)


# ---- more than 2^31 elements -----------------------------------------------------------------

def need_device_memory(nbytes):
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.0f} GiB of free device memory, {free / 2**30:.0f} GiB free")


def fill_random(x, seed):
    """Normal values in place, a slab at a time (the float32 temporaries stay ~1 GB)."""
    import cupy

    gen = cupy.random.default_rng(seed)
    step = max(1, (2**28) // (x[0].size or 1))
    for start in range(0, x.shape[0], step):
        x[start:start + step] = gen.standard_normal(x[start:start + step].shape, dtype=cupy.float32)


def test_batch_and_heads_beyond_2_31_elements():
    """65600 heads x 513 rows x 64 dims = 2.15e9 elements per tensor, read through (B, N, H, d)
    views: row * row_stride, the output's (batch * nq + q) * d and the backward's float32
    accumulators all pass 2^31, and 65600 slices need grid.z. Sampled heads against float64."""
    import cupy

    import cuflash

    heads, n, d = 65600, 513, 64
    assert heads * n * d > 2**31
    need_device_memory(11 * heads * n * d * 2)  # q, k, v, dO, O, dQ (x3 with its fp32 sum), dK, dV
    buffers = [cupy.empty((1, n, heads, d), cupy.float16) for _ in range(4)]
    for seed, x in enumerate(buffers):
        fill_random(x[0], seed)
    q, k, v, do = (x.swapaxes(1, 2) for x in buffers)
    out = cuflash.attention(q, k, v, causal=True)
    grads = cuflash.attention_backward(do, q, k, v, *out, causal=True)
    for h in (0, 1, 32767, 65535, heads - 1):  # 65535: the first slice on grid.z = 1
        host = [cupy.asnumpy(x[0, h]) for x in (q, k, v, do)]
        check_forward(cuflash.AttentionOutput(*(x[0, h] for x in out)), *host[:3], causal=True, dtype="float16")
        check_backward([g[0, h] for g in grads], host[3], *host[:3], causal=True, dtype="float16")


@pytest.mark.parametrize("dtype", ("float16", "float32"))
def test_one_slice_with_keys_beyond_2_31_elements(dtype, rng):
    """2^25 + 77 keys of 64 dims in one slice: key_row * row_stride passes 2^31.

    Keys and values are zero except four, each 8 x a query, at 5, 2^25 - 3, 2^25 + 1 (past
    element 2^31) and the last row. Query i's own key scores |q_i|^2 ~ 64, so the 3e7 zero
    keys (weight e^-64 each) add nothing measurable, and attention over the four keys alone is
    the reference -- a read of the wrong key rows would lose a dominant key.
    """
    import cupy

    import cuflash

    nk, d = 2**25 + 77, 64
    itemsize = np.dtype(dtype).itemsize
    need_device_memory(5 * nk * d * itemsize)
    special = [5, 2**25 - 3, 2**25 + 1, nk - 1]
    q = random_array(rng, (1, 4, d), dtype)
    k_special = (8 * q.astype(np.float32)).astype(q.dtype)
    v_special = (0.25 * random_array(rng, (1, 4, d), "float32")).astype(q.dtype)
    do = random_array(rng, (1, 4, d), dtype)
    k = cupy.zeros((1, nk, d), q.dtype)
    v = cupy.zeros((1, nk, d), q.dtype)
    k[:, special], v[:, special] = to_device(k_special), to_device(v_special)
    out = cuflash.attention(to_device(q), k, v)
    check_forward(out, q, k_special, v_special, causal=False, dtype=dtype)
    grads = cuflash.attention_backward(to_device(do), to_device(q), k, v, *out)
    check_backward([grads.dq, grads.dk[:, special], grads.dv[:, special]], do, q, k_special, v_special,
                   causal=False, dtype=dtype)
    # Zero keys all get the same (tiny) gradient, written wherever they are.
    zero_keys = [0, 1, 2**25 - 1, 2**25, 2**25 + 2, nk - 2]
    for g in (grads.dk, grads.dv):
        rows = bits(g[0, zero_keys])
        assert (rows == rows[0]).all(), "zero keys got different gradients"
        assert np.isfinite(to_host64(g[0, zero_keys])).all()


# ---- threads, streams, devices, aliasing -----------------------------------------------------

def test_threads_on_first_use_compile_each_variant_once(monkeypatch, rng):
    """Eight threads start at once on an empty kernel cache with four problems (two variants
    each); every variant is built once and every result is right."""
    import cupy

    import cuflash
    from cuflash import _config, _loader

    monkeypatch.setattr(_loader, "_modules", {})
    builds = collections.Counter()
    lock = threading.Lock()
    raw_module = cupy.RawModule

    def counting_raw_module(*args, **kwargs):
        with lock:
            builds.update(kwargs.get("name_expressions", ()))
        return raw_module(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting_raw_module)
    problems = [("bfloat16", 64, False), ("float16", 128, True), ("float32", 96, False), ("bfloat16", 64, True)]
    inputs = [[random_array(rng, (2, 3, n, d), dtype) for n in (100, 130, 130, 100)]
              for dtype, d, _ in problems for _ in range(2)]
    start = threading.Barrier(len(inputs))

    def work(index):
        dtype, d, causal = problems[index // 2]
        start.wait()
        out, grads = forward_backward(*inputs[index], causal=causal)
        return [x.get() for x in (*out, *grads)]

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        results = list(pool.map(work, range(len(inputs))))
    expected = set()
    arch = cupy.cuda.Device().compute_capability
    hopper, wgmma = _config.is_hopper(arch), _config.has_wgmma(arch)
    for dtype, d, causal in problems:
        plan = _config.backward_plan(dtype, d, d, causal, False, hopper=hopper, wgmma=wgmma)
        forward = _config.forward_config(dtype, d, d, causal, wgmma=wgmma, nq=100)
        kernels = (forward, plan.preprocess, *plan.key_passes, plan.dq)
        expected |= {x.name_expression for x in kernels if x is not None}
    assert expected <= set(builds) and all(n == 1 for n in builds.values()), dict(builds)
    for index, result in enumerate(results):
        dtype, _, causal = problems[index // 2]
        q, k, v, do = inputs[index]
        host = [cupy.asarray(x) for x in result]
        check_forward(cuflash.AttentionOutput(*host[:3]), q, k, v, causal=causal, dtype=dtype)
        check_backward(host[3:], do, q, k, v, causal=causal, dtype=dtype)


DELAYED_COPY = r"""
extern "C" __global__ void delayed_copy(const unsigned char* src, unsigned char* dst,
                                        long long n, long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def produced_late(sources, cycles=2 * 10**8):
    """Device copies of ``sources`` that a kernel on the current stream writes only after
    spinning ``cycles`` clocks (~0.1 s); until then they hold NaN."""
    import cupy

    kernel = cupy.RawKernel(DELAYED_COPY, "delayed_copy")
    staged = [to_device(x) for x in sources]
    targets = [cupy.full(x.shape, np.nan, x.dtype) for x in staged]
    cupy.cuda.Device().synchronize()  # staging and NaN fill done; only the copy is late
    for src, dst in zip(staged, targets):
        kernel((64,), (256,), (src, dst, np.int64(src.nbytes), np.int64(cycles)))
    return targets


def test_inputs_produced_late_on_a_cupy_stream(rng):
    import cupy

    import cuflash

    q, k, v, do = (random_array(rng, (2, 4, n, 64), "bfloat16") for n in (300, 500, 500, 300))
    stream = cupy.cuda.Stream(non_blocking=True)  # no implicit ordering with the null stream
    with stream:
        q_d, k_d, v_d, do_d = produced_late((q, k, v, do))
        out = cuflash.attention(q_d, k_d, v_d, causal=True)
        grads = cuflash.attention_backward(do_d, q_d, k_d, v_d, *out, causal=True)
        host = [x.get() for x in (*out, *grads)]  # a copy on the stream, after the kernels
    check_forward(cuflash.AttentionOutput(*(cupy.asarray(x) for x in host[:3])), q, k, v, causal=True, dtype="bfloat16")
    check_backward([cupy.asarray(x) for x in host[3:]], do, q, k, v, causal=True, dtype="bfloat16")


def test_inputs_produced_late_on_a_torch_stream(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_sleep"):
        pytest.skip("needs CUDA torch with torch.cuda._sleep")
    import cupy

    import cuflash
    import cuflash.torch

    q, k, v = (random_array(rng, (2, 4, n, 64), "float16") for n in (300, 500, 500))
    staged = [torch.from_dlpack(to_device(x)) for x in (q, k, v)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2 * 10**8)
        late = [x.clone() for x in staged]  # queued behind the sleep
        adapter = cuflash.torch.attention(*late, causal=True)  # runs on torch's current stream
        # The CuPy API on torch tensors: DLPack makes CuPy's stream wait for torch's.
        plain = cuflash.attention(*late, causal=True)
    side.synchronize()
    cupy.cuda.Device().synchronize()
    check_forward(plain, q, k, v, causal=True, dtype="float16")
    np.testing.assert_array_equal(bits(cupy.from_dlpack(adapter)), bits(plain.o))


def test_arrays_on_another_device_run_there():
    import cupy

    import cuflash

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng()
    q, k, v, do = (random_array(rng, (2, 100, 64), "float16") for _ in range(4))
    with cupy.cuda.Device(1):
        q1, k1, v1, do1 = (to_device(x) for x in (q, k, v, do))
    assert cupy.cuda.Device().id == 0
    out = cuflash.attention(q1, k1, v1, causal=True)
    grads = cuflash.attention_backward(do1, q1, k1, v1, *out, causal=True)
    assert all(x.device.id == 1 for x in (*out, *grads))
    with cupy.cuda.Device(1):
        check_forward(out, q, k, v, causal=True, dtype="float16")
        check_backward(grads, do, q, k, v, causal=True, dtype="float16")
    with pytest.raises(ValueError, match="one device"):
        cuflash.attention(to_device(q), k1, v1)


def extent(x):
    """[first byte, last byte + 1) of the memory an array can reach."""
    if x.size == 0:
        return (x.data.ptr, x.data.ptr)
    low = x.data.ptr + sum(s * (n - 1) for s, n in zip(x.strides, x.shape) if s < 0)
    high = x.data.ptr + sum(s * (n - 1) for s, n in zip(x.strides, x.shape) if s > 0) + x.itemsize
    return (low, high)


@pytest.mark.parametrize(
    "dtype,q_shape,kv_shape",
    (
        ("bfloat16", (2, 4, 70, 64), (2, 4, 90, 64)),  # dK, dV written final by the kernel
        ("float16", (2, 4, 70, 64), (2, 2, 90, 64)),  # grouped: dK, dV summed from fp32
        ("float32", (2, 4, 70, 64), (4, 90, 64)),  # broadcast, float32 throughout
        ("float16", (2, 4, 70, 64), (2, 4, 0, 64)),  # no keys: the early-return path
    ),
)
def test_outputs_never_alias_inputs_and_inputs_stay_intact(dtype, q_shape, kv_shape, rng):
    import cuflash

    q, k, v = (to_device(random_array(rng, s, dtype)) for s in (q_shape, kv_shape, kv_shape))
    do = to_device(random_array(rng, q_shape, dtype))
    before = [bits(x) for x in (q, k, v, do)]
    out = cuflash.attention(q, k, v, causal=True)
    out_before = [bits(x) for x in out]
    grads = cuflash.attention_backward(do, q, k, v, *out, causal=True)
    inputs, results = (q, k, v, do, *out), (*out, *grads)
    for i, a in enumerate(results):
        for b in inputs[:4] + results[i + 1:]:
            (a0, a1), (b0, b1) = extent(a), extent(b)
            assert a1 <= b0 or b1 <= a0 or a.size == 0 or b.size == 0, "an output overlaps another array"
    for name, x, was in zip(("q", "k", "v", "do", "o", "l", "m"), inputs, before + out_before):
        np.testing.assert_array_equal(bits(x), was, err_msg=f"{name} was modified")
