"""The launch plans (cuflash/_forward.py, _backward.py, through cuflash/_spine.py) on the CPU:
the driver, the kernels and the tensor maps are stand-ins that record what a launch would
receive."""

import ctypes
import struct
import types

import ml_dtypes
import numpy as np
import pytest

from cuflash import _cache, _config, _decode, _driver, _launch, _loader, _params, _spine, _tiles, _tma, _variants


class _FakeDriver:
    """libcuda's calls as the plans make them (cuflash/_driver.py), recorded."""

    def __init__(self):
        self.launches = []
        self.memsets = []
        self.current = 77  # the context current on the calling thread

    def launch_kernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv):
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]  # the first parameter block
        words = ctypes.cast(first, ctypes.POINTER(ctypes.c_uint64))
        params = [tuple(words[j] for j in range(12))]
        self.launches.append(dict(func=func, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream, params=params))
        return 0

    def memset_async(self, ptr, nbytes, stream):
        self.memsets.append((ptr, nbytes, stream))
        return 0

    def current_context(self):
        return self.current

    def cuCtxPushCurrent_v2(self, ctx):
        return 0

    def cuCtxPopCurrent_v2(self, out):
        return 0


class _Function:
    def __init__(self, ptr):
        self.ptr = ptr


class _RawKernel:
    def __init__(self, variant):
        self.kernel = _Function(abs(hash(variant.key)) % 10**6)
        self.max_dynamic_shared_size_bytes = 48 * 1024


def _fake_encode(ptr, cols, rows, row_stride, stride, count, box_rows, patchable=True):
    geometry = struct.pack("<6q", cols, rows, row_stride, stride, count, box_rows)
    head = struct.pack("<Q", ptr) if patchable else struct.pack("<Q", ptr >> 4)
    return (head + geometry).ljust(_tma.MAP_BYTES, b"\0")


@pytest.fixture
def fake_gpu(monkeypatch):
    driver = _FakeDriver()
    built = []

    def get_kernel(variant, device=None):
        built.append(variant.key)
        return _RawKernel(variant)

    monkeypatch.setattr(_driver, "driver", lambda: driver)
    monkeypatch.setattr(_driver, "device_context", lambda device_id: 77)
    monkeypatch.setattr(_driver, "compute_capability", lambda device_id: "90")
    monkeypatch.setattr(_driver, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(_driver, "device", lambda device_id: _NullContext())
    monkeypatch.setattr(_loader, "get_kernel", get_kernel)
    monkeypatch.setattr(_tma, "encode", _fake_encode)
    _cache.clear()
    driver.built = built
    yield driver
    _cache.clear()


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _contiguous(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _forward(shape=(2, 4, 256, 64), kv_shape=None, dtype="bfloat16", causal=False, window=None,
             strides=None, ptrs=(0x1000, 0x20000, 0x40000)):
    kv_shape = kv_shape or shape
    q_strides = strides or _contiguous(shape)
    return _forward_problem_plan((shape, kv_shape, kv_shape), (q_strides, _contiguous(kv_shape), _contiguous(kv_shape)),
                                 dtype, ptrs, causal=causal, window=window)


def _forward_problem_plan(shapes, strides, dtype, ptrs, **options):
    problem = _spine.forward_problem(shapes, strides, (dtype,) * 3, 0, **options)
    return _spine.forward(problem, ptrs)


def _backward_problem_plan(shapes, strides, dtype, stats, ptrs, **options):
    problem = _spine.backward_problem(shapes, strides, (dtype,) * 5, stats, 0, **options)
    return _spine.backward(problem, ptrs)


def test_a_known_signature_builds_nothing(fake_gpu):
    plan = _forward()
    built = len(fake_gpu.built)
    assert _forward(ptrs=(0x9000, 0x90000, 0xA0000)) is plan  # other pointers: same plan
    assert len(fake_gpu.built) == built and _cache.plan_counts() == (1, 0)


@pytest.mark.parametrize("change", [
    dict(dtype="float16"), dict(causal=True), dict(window=(64, 0)),
    dict(strides=(4 * 256 * 128, 256 * 128, 128, 1)),  # a strided view of a wider buffer
    dict(kv_shape=(2, 2, 256, 64)),  # grouped heads
])
def test_a_changed_signature_builds_a_new_plan(fake_gpu, change):
    plan = _forward()
    assert _forward(**change) is not plan
    assert _cache.plan_counts() == (2, 0)


def test_switches_build_new_plans(fake_gpu):
    plan = _forward()
    with _config.wgmma_forward(False):
        other = _forward()
    assert other is not plan and not isinstance(other.variant, _variants.HopperForward)
    assert isinstance(plan.variant, _variants.HopperForward)


def test_a_run_writes_its_pointers_and_launches_once(fake_gpu):
    plan = _forward()
    plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000), 42)
    plan.run((0x1100, 0x2100, 0x3100, 0x4100, 0x5100, 0x6100), 43)
    first, second = fake_gpu.launches
    assert first["params"][0][:6] == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000)
    assert second["params"][0][:6] == (0x1100, 0x2100, 0x3100, 0x4100, 0x5100, 0x6100)
    assert (first["stream"], second["stream"]) == (42, 43)
    # the tensor maps carry each call's addresses (the patchable encoding): words 0, 16, 32
    maps = ctypes.cast(plan.kernel.argv[1], ctypes.POINTER(ctypes.c_uint64))
    assert (maps[0], maps[16], maps[32]) == (0x1100, 0x2100, 0x3100)
    assert first["smem"] == plan.variant.smem_bytes() and first["block"] == (plan.variant.threads, 1, 1)


@pytest.mark.parametrize("d,longest,persistent", ((64, 1000, True), (64, 1100, False), (128, 500, True),
                                                  (128, 1000, False), (256, 1000, False)))
def test_packed_batches_take_the_persistent_grid_where_dense_ones_do(fake_gpu, d, longest, persistent):
    """A packed (varlen) forward is persistent, one CTA an SM walking (tile, sequence, head)
    items, where a dense batch of its longest sequence would be; its parameter block then says
    how many tiles an item's x runs over (varlen_tiles, the last word); otherwise a grid of
    (tiles, slices)."""
    heads, seqs, total = 4, 3, 2500
    shape = (heads, total, d)
    plan = _forward_problem_plan((shape,) * 3, (_contiguous(shape),) * 3, "bfloat16", (0x1000, 0x20000, 0x40000),
                                 causal=True, varlen=_spine.Varlen(seqs, longest))
    plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000), 42)
    (launch,) = fake_gpu.launches
    tiles = -(-longest // 128)
    assert plan.kernel.variant.varlen and plan.kernel.variant.persistent == persistent
    bound = _config.persistent_query_tiles(d, causal=True)
    assert (bound is not False and tiles <= bound) == persistent
    words = struct.unpack(_params.FWD_PARAM_FORMAT, ctypes.string_at(plan.kernel.argv[0],
                                                                      struct.calcsize(_params.FWD_PARAM_FORMAT)))
    assert words[_params.CU_SEQLENS_WORD:_params.CU_SEQLENS_WORD + 2] == (0x7000, 0x8000)
    assert words[-2:] == (seqs, tiles if persistent else 0)  # num_seqs, varlen_tiles
    assert launch["grid"] == ((min(tiles * heads * seqs, 132), 1, 1) if persistent else (tiles, heads * seqs, 1))


def test_maps_are_encoded_once_per_pointer_triple_when_not_patchable(fake_gpu, monkeypatch):
    calls = []

    def encode(ptr, *geometry):
        calls.append(ptr)
        return _fake_encode(ptr, *geometry, patchable=False)

    monkeypatch.setattr(_tma, "encode", encode)
    plan = _forward()
    assert not plan.maps.patchable
    calls.clear()
    for _ in range(3):
        plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000), 1)
    assert calls == [0x1000, 0x2000, 0x3000]  # encoded for the first run only
    plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000), 1)
    assert len(calls) == 3


def test_misaligned_pointers_get_the_same_error_cached_or_not(fake_gpu):
    with pytest.raises(ValueError, match=r"q must be 16-byte aligned.*address 0x1008") as fresh:
        _forward(ptrs=(0x1008, 0x20000, 0x40000))
    plan = _forward()
    with pytest.raises(ValueError, match=r"q must be 16-byte aligned.*address 0x1008") as cached:
        plan.run((0x1008, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000), 1)
    assert str(fresh.value) == str(cached.value)
    assert not fake_gpu.launches


def test_bad_shapes_raise_the_same_error_with_neighbours_cached(fake_gpu):
    def bad():
        return _forward(shape=(2, 4, 256, 64), kv_shape=(2, 4, 256, 60))

    with pytest.raises(ValueError) as before:
        bad()
    _forward()
    _forward(kv_shape=(2, 2, 256, 64))
    with pytest.raises(ValueError) as after:
        bad()
    assert str(before.value) == str(after.value) and "head dim" in str(before.value)


def _backward(shape=(2, 4, 256, 64), kv_shape=None, dtype="bfloat16", deterministic=False, causal=False):
    kv_shape = kv_shape or shape
    shapes = (shape, shape, kv_shape, kv_shape, shape)
    strides = tuple(_contiguous(s) for s in shapes)
    stats = ((shape[:-1], _contiguous(shape[:-1]), "float32"),) * 2
    return _backward_problem_plan(shapes, strides, dtype, stats, (0x1000,) * 5, causal=causal,
                                  deterministic=deterministic)


def _key_pass(plan):
    return next(k for k in plan.kernels if isinstance(k.variant, _variants.HopperBackward))


@pytest.mark.parametrize("shape,items", (((2, 4, 256, 64), 16), ((4, 32, 1024, 64), 1024)))
def test_backward_key_pass_is_persistent_at_head_dim_64_when_not_causal(fake_gpu, shape, items):
    """At the head dims of _tiles.SM90_PERSISTENT_BACKWARD_DIMS a dense key pass that is not
    causal runs one CTA an SM over its (key tile, slice) items, or one a CTA where there are
    fewer; causal, head dim 128, deterministic and cp.async key passes take a CTA an item."""
    assert _tiles.SM90_PERSISTENT_BACKWARD_DIMS == (64,)
    key_pass = _key_pass(_backward(shape))
    assert key_pass.variant.persistent and key_pass.variant.tma
    assert key_pass.grid == (min(items, 132), 1, 1)
    # a second K and V (128 keys x 64, 16-bit) and three barriers
    assert key_pass.smem == _key_pass(_backward(shape, causal=True)).smem + 2 * 128 * 64 * 2 + 3 * 8
    for plan in (_backward(shape, causal=True), _backward(shape[:-1] + (128,)), _backward(shape, deterministic=True)):
        key_pass = _key_pass(plan)
        assert not key_pass.variant.persistent
        assert key_pass.grid[0] == -(-shape[2] // 128) and key_pass.grid[1] == shape[0] * shape[1]
    for kwargs in (dict(sparse=True), dict(varlen=True), dict(grouped=True), dict(tma=False)):
        assert not _config.backward_plan("bfloat16", 64, 64, False, False, wgmma=True, **kwargs).key_passes[0].persistent


def test_persistent_key_pass_past_2_31_items_takes_a_cta_an_item(fake_gpu):
    """The persistent walk counts (key tile, slice) items in 32 bits: a k broadcast over 2^22
    query slices with 2^13 key tiles (2^35 items) runs the one-item-a-CTA form, which the
    compile check builds too."""
    big = _key_pass(_backward((4096, 1024, 64, 64), kv_shape=(1, 1, 2**20, 64)))
    assert not big.variant.persistent and big.variant.tma and not big.variant.causal
    assert big.variant in _config.variants_for("sm_90a")
    assert _key_pass(_backward((2, 4, 64, 64), kv_shape=(1, 1, 2**20, 64))).variant.persistent


def test_backward_plan_zeroes_dq_and_finishes_it_in_one_kernel(fake_gpu):
    plan = _backward()
    assert _backward() is plan and _cache.plan_counts() == (0, 1)
    kinds = [g.kind for g in plan.grads]
    assert kinds == ["reduce", "direct", "direct"]  # dK, dV written in place; dQ from float32
    plan.run((*(0x1000 * (i + 1) for i in range(10)), 0x100000), 5)
    assert fake_gpu.memsets == []  # the preprocess (the first launch) zeroes the accumulator
    assert isinstance(plan.kernels[0].variant, _variants.BackwardPreprocess) and plan.kernels[0].params[1] is plan.bwd_block
    block = list(plan.bwd_block)  # struct BwdParams: dq_acc, ..., zero_dq_acc
    assert block[6] == 0x100000 + plan.grads[0].offset and block[-1] == 1
    reduce = fake_gpu.launches[-1]
    assert reduce["params"][0][:5] == (0x100000 + plan.grads[0].offset, 0x8000, 1, 256 * 64, 8)


def test_backward_key_pass_loads_through_tensor_maps(fake_gpu):
    """The wgmma key pass gets four tensor maps (struct Bwd90Maps: q, k, v, dO), each over its
    own strides (here q a (batch, seq, heads, d) view), with each call's addresses."""
    shape = (2, 4, 256, 64)
    q_strides = (256 * 4 * 64, 64, 4 * 64, 1)
    shapes = (shape,) * 5
    strides = (_contiguous(shape), q_strides, _contiguous(shape), _contiguous(shape), _contiguous(shape))
    stats = ((shape[:-1], _contiguous(shape[:-1]), "float32"),) * 2
    plan = _backward_problem_plan(shapes, strides, "bfloat16", stats, (0x1000,) * 5, causal=True)
    key_pass = _key_pass(plan)
    assert key_pass.variant.tma and len(key_pass.params) == 3
    plan.run((*(0x1000 * (i + 1) for i in range(10)), 0x100000), 5)
    maps = list(key_pass.params[2])
    assert maps[0:64:16] == [0x2000, 0x3000, 0x4000, 0x1000]  # q, k, v, dO
    geometry = [maps[16 * i + 1:16 * i + 7] for i in range(4)]  # (cols, rows, row stride, slice stride, count, box)
    assert geometry[0] == [64, 256, 4 * 64, 64, 256 * 4 + 4, 64]  # q: heads 64 elements apart
    assert geometry[1] == geometry[2] == [64, 256, 64, 256 * 64, 8, 128]  # k, v: boxes of a CTA's keys
    assert geometry[3] == [64, 256, 64, 256 * 64, 8, 64]  # dO: contiguous
    assert maps[64:68] == [64, 256 * 64, 256 * 64, 256 * 64]  # the slice strides, as the kernel divides by them


def test_packed_backward_maps_span_every_row_of_a_head(fake_gpu):
    """A packed batch's key pass loads through maps of (d, total rows, heads): the kernel adds
    each sequence's first row to its tiles' rows."""
    heads, kv_heads, total_q, total_k, d = 8, 2, 700, 650, 128
    q, kv = (heads, total_q, d), (kv_heads, total_k, d)
    shapes = (q, q, kv, kv, q)
    strides = tuple(_contiguous(s) for s in shapes)
    stats = (((heads, total_q), (total_q, 1), "float32"),) * 2
    plan = _backward_problem_plan(shapes, strides, "bfloat16", stats, (0x1000,) * 5, causal=True,
                                  varlen=_spine.Varlen(3, 400, 400))
    key_pass = _key_pass(plan)
    assert key_pass.variant.varlen and key_pass.variant.tma
    plan.run((*(0x1000 * (i + 1) for i in range(10)), 0x100000, 0x200000, 0x300000), 5)
    maps = list(key_pass.params[2])
    assert maps[0:64:16] == [0x2000, 0x3000, 0x4000, 0x1000]  # q, k, v, dO
    geometry = [maps[16 * i + 1:16 * i + 7] for i in range(4)]
    assert geometry[0] == geometry[3] == [d, total_q, d, total_q * d, heads, 64]
    assert geometry[1] == geometry[2] == [d, total_k, d, total_k * d, kv_heads, 128]


def test_backward_key_pass_without_maps_loads_with_cp_async(fake_gpu, monkeypatch):
    monkeypatch.setattr(_tma, "encode", lambda *args: None)
    plan = _backward()
    key_pass = _key_pass(plan)
    assert not key_pass.variant.tma and plan.maps is None
    assert not any(key_pass.params[2])  # the kernel's maps parameter, unread


def test_backward_pointers_the_copy_engine_refuses_run_the_cp_async_form(fake_gpu, monkeypatch):
    """Maps encoded per pointer tuple (not patchable): a call whose dO the copy engine refuses
    runs the plan's cp.async form instead; the next mappable call runs the TMA form again."""
    refused = 0x900000

    def encode(ptr, *geometry):
        return None if ptr == refused else _fake_encode(ptr, *geometry, patchable=False)

    monkeypatch.setattr(_tma, "encode", encode)
    plan = _backward()

    def key_pass_funcs(call):
        fake_gpu.launches.clear()
        plan.run((*call, 0x100000), 5)
        return [x["func"] for x in fake_gpu.launches]

    mappable = tuple(0x1000 * (i + 1) for i in range(10))
    tma_func = _key_pass(plan).func
    cp_async = _key_pass(plan.fallback())
    assert not cp_async.variant.tma and cp_async.func != tma_func
    assert tma_func in key_pass_funcs(mappable)
    funcs = key_pass_funcs((refused,) + mappable[1:])
    assert cp_async.func in funcs and tma_func not in funcs
    assert tma_func in key_pass_funcs(mappable)


def test_grouped_heads_sum_dk_dv_in_the_reduce_kernel(fake_gpu):
    plan = _backward(kv_shape=(2, 2, 256, 64))
    assert [(g.kind, g.group) for g in plan.grads] == [("reduce", 1), ("reduce", 2), ("reduce", 2)]
    plan.run((*(0x1000 * (i + 1) for i in range(10)), 0x100000), 5)
    dk_reduce = fake_gpu.launches[-2]["params"][0][:5]
    assert dk_reduce[1:] == (0x9000, 2, 256 * 64, 4)  # (B * Hk) slices, each summed over 2 heads


@pytest.mark.parametrize("shape,kv_heads,group", (
    ((8, 32, 2048, 128), 8, 4),    # 64 k/v heads x 16 key tiles: every CTA walks its 4 query heads
    ((4, 32, 4096, 128), 4, 4),    # all 8 a CTA would leave 512 CTAs (under 7 waves of 132): 4 of 8
    ((2, 32, 2048, 128), 8, 1),    # even 2 a CTA would leave 512: one head a CTA
    ((8, 32, 2048, 128), 32, 1),   # no k/v group
))
def test_grouped_heads_walked_by_one_key_pass_cta(fake_gpu, shape, kv_heads, group):
    kv = shape[:1] + (kv_heads,) + shape[2:]
    kv_group = shape[1] // kv_heads
    plan = _backward(shape=shape, kv_shape=kv, deterministic=False)
    key_pass = _key_pass(plan)
    assert key_pass.variant.grouped == (group > 1)
    block = list(plan.bwd_block)
    assert block[-1] == group  # BwdParams.head_group
    slices = shape[0] * shape[1] // group
    assert key_pass.grid[1] * key_pass.grid[2] == slices and key_pass.grid[0] == shape[2] // 128
    kinds = [(g.kind, g.group, g.acc_shape) for g in plan.grads[1:]]
    if group == kv_group:  # summed whole in the kernel: written in place, no reduce
        assert kinds == [("direct", 1, kv)] * 2 and len(plan.reduces) == 1
    elif kv_group > 1:  # float32 sums over `group` heads, the rest summed by grad_reduce
        acc = shape[:1] + (shape[1] // group,) + shape[2:]
        assert kinds == [("reduce", kv_group // group, acc)] * 2 and len(plan.reduces) == 3
    waves = _config.GROUPED_BACKWARD_WAVES
    assert _config.backward_head_group(4, 4 * waves * 132, 1, 132) == 4
    assert _config.backward_head_group(4, 4 * waves * 132 - 4, 1, 132) == 2
    assert _config.backward_head_group(3, 8, 1, 132) == 1


def test_broadcast_q_is_left_to_the_framework(fake_gpu):
    shape, kv = (1, 4, 256, 64), (3, 4, 256, 64)
    shapes = (kv, shape, kv, kv, kv)
    strides = tuple(_contiguous(s) for s in shapes)
    stats = ((kv[:-1], _contiguous(kv[:-1]), "float32"),) * 2
    plan = _backward_problem_plan(shapes, strides, "float16", stats, (0x1000,) * 5, causal=True)
    assert plan.grads[0].kind == "generic" and plan.grads[0].acc_shape == (3, 4, 256, 64)


def test_empty_problems_zero_the_gradients(fake_gpu):
    plan = _backward(shape=(2, 4, 0, 64), kv_shape=(2, 4, 256, 64))
    plan.run((*(0x1000 * (i + 1) for i in range(10)), 0), 5)
    assert not fake_gpu.launches and len(fake_gpu.memsets) == 2  # dq has no elements


def test_a_failed_launch_names_the_variant(fake_gpu, monkeypatch):
    plan = _forward()
    monkeypatch.setattr(fake_gpu, "launch_kernel", lambda *args: 700)
    monkeypatch.setattr(fake_gpu, "cuGetErrorName",
                        lambda status, out: setattr(out._obj, "value", b"CUDA_ERROR_ILLEGAL_ADDRESS") or 0,
                        raising=False)
    with pytest.raises(RuntimeError, match=rf"launching {plan.variant.key} failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000), 1)


def test_sparse_forward_is_persistent_where_its_rows_visit_few_key_tiles():
    """The rule of _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES: the mean key tiles a query tile
    visits (from the mask's tile lists, causal and window included) at or under the entry
    makes a long sparse forward persistent; above it, or without an entry, the length decides."""
    from cuflash import masks

    n = 64 * 128
    dense_rule = _config.forward_config("bfloat16", 64, 64, False, sparse=True, wgmma=True, nq=n)
    assert not dense_rule.persistent
    tiles = (dense_rule.block_rows, dense_rule.block_cols)  # 128 queries x 128 keys

    def row_tiles(mask, causal=False):
        return _launch.sparse_row_tiles(mask, n, n, *tiles, causal=causal, window=None)

    assert 3 <= row_tiles(masks.local(64, 2)) <= 5  # rows visit 3-5 key tiles
    assert row_tiles(masks.dense(64)) == 64
    assert row_tiles(masks.dense(64), causal=True) == 32.5  # causal halves it
    limit = _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES[64]
    for visited, persistent in ((limit, True), (limit + 0.5, False)):
        for d in (64, 128):
            asked = []
            chosen = _config.forward_config("bfloat16", d, d, False, sparse=True, wgmma=True, nq=n,
                                            row_tiles=lambda br, bc: asked.append((br, bc)) or visited)
            assert chosen.persistent == (persistent and d in _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES)
            assert asked == ([(chosen.block_rows, chosen.block_cols)] if d in _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES
                             else [])  # asked with the tiles it decides for, and only where it decides
    dense = _config.forward_config("bfloat16", 64, 64, False, wgmma=True, nq=n, row_tiles=lambda br, bc: 1)
    assert not dense.persistent  # row_tiles speaks for block-sparse launches only


def test_every_plan_runs_on_named_pointers(fake_gpu):
    """Forward, backward and decoding plans are one type: run(pointers, stream), the pointers in
    the order pointer_names gives (a varlen batch's boundaries last)."""
    shape = (4, 2500, 64)
    packed = _forward_problem_plan((shape,) * 3, (_contiguous(shape),) * 3, "bfloat16", (0x1000,) * 3,
                                   varlen=_spine.Varlen(3, 1000))
    plans = {_forward(): ("q", "k", "v", "o", "l", "m"),
             packed: ("q", "k", "v", "o", "l", "m", "cu_seqlens_q", "cu_seqlens_k"),
             _backward(): ("do", "q", "k", "v", "o", "l", "m", "dq", "dk", "dv", "workspace")}
    choice = _decode.plan_decode(*(_HostMeta((2, 8, s, 64)) for s in (1, 4096, 4096)), sm_count=132)
    plans[_spine.bound_plan(choice, 0)] = ("q", "k", "v", "o", "l", "m", "page_table", "seqlens_k", "workspace")
    for plan, names in plans.items():
        assert isinstance(plan, _launch.Plan) and plan.pointer_names == names
        fake_gpu.launches.clear()
        plan.run(tuple(0x10000 * (i + 1) for i in range(len(names))), 9)
        assert fake_gpu.launches and all(x["stream"] == 9 for x in fake_gpu.launches)


class _HostMeta:
    """What the decoding checks read of a C-contiguous bfloat16 array at a 16-byte aligned address."""

    def __init__(self, shape):
        self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(ml_dtypes.bfloat16)
        self.strides = tuple(2 * s for s in _contiguous(shape))
        self.data, self.device = types.SimpleNamespace(ptr=0x1000), types.SimpleNamespace(id=0)
        self.flags = types.SimpleNamespace(c_contiguous=True)
