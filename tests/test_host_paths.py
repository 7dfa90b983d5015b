"""The front ends' host paths end to end on the CPU: CuPy arrays over no memory, the driver, the
compiler and the tensor maps stood in for (what the kernels would receive is recorded). Each
call runs through the spine as on a GPU: arguments -> problem -> plan -> outputs -> launch, and a
repeated signature builds nothing again."""

import ctypes
import struct
import types

import numpy as np
import pytest

from cuflash import _cache, _driver, _loader, _params, _tma, _variants

cupy = pytest.importorskip("cupy")


class _Driver:
    def __init__(self):
        self.launches = []

    def launch_kernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv):
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        words = ctypes.cast(first, ctypes.POINTER(ctypes.c_uint64))
        self.launches.append(dict(variant=_FUNCS[func], grid=(gx, gy, gz), stream=stream,
                                  words=tuple(words[i] for i in range(64))))
        return 0

    def memset_async(self, ptr, nbytes, stream):
        return 0

    def current_context(self):
        return 77

    def cuCtxPushCurrent_v2(self, ctx):
        return 0

    def cuCtxPopCurrent_v2(self, out):
        return 0


_FUNCS: dict = {}  # CUfunction stand-in -> its variant


def _raw_kernel(variant, device=None):
    func = len(_FUNCS) + 1
    _FUNCS[func] = variant
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=func), max_dynamic_shared_size_bytes=1 << 20)


class _Device:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_HEAP = cupy.cuda.UnownedMemory(1 << 20, 1 << 40, None, 0)  # addresses only: nothing is read or written


class _Array(cupy.ndarray):
    """A CuPy array over no memory whose device needs no driver to enter."""

    @property
    def device(self):
        return _Device(0)


def _array(shape, dtype=np.float16, at=0):
    return cupy.ndarray.__new__(_Array, shape, dtype, cupy.cuda.MemoryPointer(_HEAP, at))


@pytest.fixture
def gpu(monkeypatch):
    """The stood-in GPU: its driver records the launches; CuPy's allocations hand out fresh
    addresses."""
    driver = _Driver()
    monkeypatch.setattr(_driver, "driver", lambda: driver)
    monkeypatch.setattr(_driver, "device_context", lambda device_id: 77)
    monkeypatch.setattr(_driver, "compute_capability", lambda device_id: "90")
    monkeypatch.setattr(_driver, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(_driver, "device", lambda device_id: _Device(device_id))
    monkeypatch.setattr(_loader, "get_kernel", _raw_kernel)
    monkeypatch.setattr(_tma, "encode", lambda ptr, *geometry: struct.pack("<Q", ptr) + bytes(_tma.MAP_BYTES - 8))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *args: types.SimpleNamespace(ptr=5))
    monkeypatch.setattr(cupy.cuda, "Device", _Device)
    top = [1 << 32]

    def alloc(nbytes):
        top[0] += -(-nbytes // 4096) * 4096 + 4096
        return cupy.cuda.MemoryPointer(_HEAP, top[0])

    monkeypatch.setattr(cupy.cuda, "alloc", alloc)
    _cache.clear()
    yield driver
    _cache.clear()


def _qkv(shape, kv_shape=None, dtype=np.float16):
    kv_shape = kv_shape or shape
    return _array(shape, dtype, 0), _array(kv_shape, dtype, 1 << 24), _array(kv_shape, dtype, 2 << 24)


def test_a_forward_launches_on_its_outputs_and_builds_once(gpu):
    import cuflash

    q, k, v = _qkv((2, 4, 256, 64))
    for _ in range(3):
        o, l, m = cuflash.attention(q, k, v, causal=True)
        assert (o.shape, l.shape, m.shape) == ((2, 4, 256, 64), (2, 4, 256), (2, 4, 256))
        assert gpu.launches[-1]["words"][:6] == tuple(x.data.ptr for x in (q, k, v, o, l, m))
        assert gpu.launches[-1]["stream"] == 5
    assert _cache.plan_counts() == (1, 0) and len(gpu.launches) == 3
    assert isinstance(gpu.launches[-1]["variant"], _variants.HopperForward)


def test_a_backward_launches_its_kernels_and_builds_once(gpu):
    import cuflash

    q, k, v = _qkv((2, 4, 256, 64))
    o, l, m = cuflash.attention(q, k, v)
    do = _array(o.shape, np.float16, 3 << 24)
    for _ in range(2):
        gpu.launches.clear()
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, l, m)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        kinds = [type(x["variant"]) for x in gpu.launches]
        assert kinds[0] is _variants.BackwardPreprocess and _variants.HopperBackward in kinds
    assert _cache.plan_counts() == (1, 1)


def test_few_queries_against_many_keys_are_routed_to_the_split_kv_kernels(gpu):
    import cuflash

    q, k, v = _qkv((4, 8, 1, 128), (4, 2, 4096, 128))
    for _ in range(2):
        gpu.launches.clear()
        o, l, m = cuflash.attention(q, k, v)
        assert o.shape == (4, 8, 1, 128) and l.shape == (4, 8, 1)
        assert isinstance(gpu.launches[0]["variant"], _variants.SplitKvDecode)
        assert not any(isinstance(x["variant"], _variants.HopperForward) for x in gpu.launches)
        assert gpu.launches[0]["words"][:6] == tuple(x.data.ptr for x in (q, k, v, o, l, m))
    with pytest.raises(ValueError, match=r"q must be 16-byte aligned.*address"):
        cuflash.attention(_array(q.shape, np.float16, 8), k, v)  # the routed call checks alignment too


def test_a_paged_decoding_call_writes_its_page_table_and_lengths(gpu):
    import cuflash

    q, k, v = _qkv((4, 8, 1, 128), (64, 2, 64, 128))
    table, lengths = _array((4, 16), np.int32, 3 << 24), _array((4,), np.int32, 4 << 24)
    o, l, m = cuflash.attention(q, k, v, page_table=table, seqlens_k=lengths)
    words = dict(zip((name for name, _ in _params.DECODE_PARAM_FIELDS), gpu.launches[0]["words"]))
    assert (words["page_table"], words["seqlens"]) == (table.data.ptr, lengths.data.ptr)
    assert (words["o"], words["l"], words["m"]) == (o.data.ptr, l.data.ptr, m.data.ptr)


def test_a_packed_batch_writes_its_boundaries(gpu):
    import cuflash

    q, k, v = _qkv((4, 1000, 64))
    cu = _array((4,), np.int32, 3 << 24)
    for _ in range(2):
        o, l, m = cuflash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=500, max_seqlen_k=500)
        words = gpu.launches[-1]["words"]
        assert words[_params.CU_SEQLENS_WORD:_params.CU_SEQLENS_WORD + 2] == (cu.data.ptr, cu.data.ptr)
        assert words[:6] == tuple(x.data.ptr for x in (q, k, v, o, l, m))
    assert _cache.plan_counts() == (1, 0)


def test_caller_given_outputs_are_written_and_checked(gpu):
    import cuflash

    q, k, v = _qkv((2, 4, 256, 64))
    out = (_array((2, 4, 256, 64), np.float16, 5 << 24), _array((2, 4, 256), np.float32, 6 << 24),
           _array((2, 4, 256), np.float32, 7 << 24))
    assert cuflash.attention(q, k, v, out=out).o is out[0]
    assert gpu.launches[-1]["words"][3:6] == tuple(x.data.ptr for x in out)
    with pytest.raises(ValueError, match="out's o overlaps q"):
        cuflash.attention(q, k, v, out=(q,) + out[1:])


# ---- the torch adapter on CPU tensors ----------------------------------------------------------


@pytest.fixture
def torch_gpu(gpu, monkeypatch):
    """The torch adapter over the stood-in GPU: CPU tensors pass its device check, and its views
    of them are CuPy arrays over no memory at the tensors' addresses."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    from cuflash import _torch_launch, _views

    monkeypatch.setattr(_torch_launch, "_check_cuda", lambda *tensors: types.SimpleNamespace(index=0, type="cuda"))
    monkeypatch.setattr(_torch_launch, "_raw_stream", lambda index: 6)

    def view(t, same_stream=False):
        dtype = np.int32 if t.dtype == torch.int32 else np.float16
        return cupy.ndarray.__new__(_Array, tuple(t.shape), dtype, cupy.cuda.MemoryPointer(_HEAP, 0),
                                    tuple(np.dtype(dtype).itemsize * s for s in t.stride()))

    monkeypatch.setattr(_views, "torch_view", view)
    return torch, ct


def test_torch_calls_run_through_the_spine(torch_gpu, gpu):
    torch, ct = torch_gpu
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    o = ct.attention(q, k, v, causal=True)
    assert o.shape == q.shape and gpu.launches[-1]["words"][:4] == (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                                     o.data_ptr())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    for _ in range(2):
        grads = torch.autograd.grad(ct.attention(*leaves, causal=True), leaves, torch.ones_like(q))
        assert [g.shape for g in grads] == [q.shape] * 3
    assert _cache.plan_counts() == (1, 1)  # one forward plan: the no-grad call and autograd's share it
    qd, kd = torch.randn(2, 8, 1, 128, dtype=torch.bfloat16), torch.randn(2, 2, 4096, 128, dtype=torch.bfloat16)
    gpu.launches.clear()
    o, l, m = ct.attention(qd, kd, kd, return_stats=True)
    assert isinstance(gpu.launches[0]["variant"], _variants.SplitKvDecode) and l.shape == (2, 8, 1)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    qv = torch.randn(2, 128, 64, dtype=torch.bfloat16)
    o = ct.attention(qv, qv, qv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=78, max_seqlen_k=78)
    assert gpu.launches[-1]["words"][_params.CU_SEQLENS_WORD:_params.CU_SEQLENS_WORD + 2] == (cu.data_ptr(),) * 2


# ---- CUFLASH_VALIDATE: the values of page tables, lengths and boundaries checked before launching


@pytest.fixture
def device_values(monkeypatch):
    """The stood-in arrays' values as a device-to-host copy would return them: set
    ``values[array.data.ptr]`` to a NumPy array."""
    values = {}
    monkeypatch.setattr(_Array, "get", lambda self, *args, **kwargs: values[self.data.ptr], raising=False)
    return values


def _int_array(values, host, at):
    array = _array(np.shape(host), np.int32, at)
    values[array.data.ptr] = np.asarray(host, np.int32)
    return array


def _expect(validate, launches, error, call):
    """With the switch on, ``call`` raises ``error`` and nothing is launched; off, it launches."""
    if validate:
        with pytest.raises(ValueError, match=error):
            call()
        assert launches == []
    else:
        call()
        assert launches


@pytest.mark.parametrize("validate", (True, False))
def test_cupy_decoding_checks_its_page_table_and_lengths_when_switched_on(gpu, device_values, monkeypatch, validate):
    import cuflash
    from cuflash import _api

    monkeypatch.setattr(_api, "_VALIDATE", validate)
    q, k, v = _qkv((4, 8, 1, 128), (64, 2, 64, 128))  # 64 pages of 64 keys; 16 a sequence: capacity 1024
    table = np.arange(64, dtype=np.int32).reshape(4, 16)
    table[1, 3] = 64  # sequence 1 (200 keys) reads entries 0..3
    bad_table = _int_array(device_values, table, 3 << 24)
    lengths = _int_array(device_values, [100, 200, 64, 1024], 4 << 24)
    good_table = _int_array(device_values, np.arange(64).reshape(4, 16), 5 << 24)
    past_capacity = _int_array(device_values, [100, 200, 1025, 0], 6 << 24)
    _expect(validate, gpu.launches, r"page_table\[1, 3\] = 64 is outside \[0, 64\).*sequence 1 of length 200",
            lambda: cuflash.attention_with_kvcache(q, k, v, page_table=bad_table, seqlens_k=lengths))
    gpu.launches.clear()
    _expect(validate, gpu.launches, r"seqlens_k\[2\] = 1025 is outside \[0, 1024\]",
            lambda: cuflash.attention_with_kvcache(q, k, v, page_table=good_table, seqlens_k=past_capacity))
    gpu.launches.clear()
    qd, kd, vd = _qkv((4, 8, 1, 128), (4, 2, 4096, 128))  # a dense cache: capacity Nk
    dense_lengths = _int_array(device_values, [4096, 4097, 0, 1], 7 << 24)
    _expect(validate, gpu.launches, r"seqlens_k\[1\] = 4097 is outside \[0, 4096\]",
            lambda: cuflash.attention_with_kvcache(qd, kd, vd, seqlens_k=dense_lengths))


@pytest.mark.parametrize("validate", (True, False))
def test_cupy_packed_batches_check_their_boundaries_forward_and_backward(gpu, device_values, monkeypatch, validate):
    import cuflash
    from cuflash import _api

    monkeypatch.setattr(_api, "_VALIDATE", validate)
    q, k, v = _qkv((4, 1000, 64))
    falling = _int_array(device_values, [0, 600, 500, 1000], 3 << 24)
    good = _int_array(device_values, [0, 500, 600, 1000], 4 << 24)
    past_rows = _int_array(device_values, [0, 500, 1001, 1000], 5 << 24)
    _expect(validate, gpu.launches, r"cu_seqlens_q must not decrease: cu_seqlens_q\[2\] = 500 is less than "
                                    r"cu_seqlens_q\[1\] = 600",
            lambda: cuflash.attention_varlen(q, k, v, falling, good, 600, 600))
    gpu.launches.clear()
    o, l, m = _array((4, 1000, 64), np.float16, 6 << 24), *(_array((4, 1000), np.float32, at << 24) for at in (7, 8))
    do = _array((4, 1000, 64), np.float16, 9 << 24)
    _expect(validate, gpu.launches, r"cu_seqlens_k\[2\] = 1001 is outside \[0, 1000\]",
            lambda: cuflash.attention_backward(do, q, k, v, o, l, m, cu_seqlens_q=good, cu_seqlens_k=past_rows,
                                               max_seqlen_q=500, max_seqlen_k=501))


@pytest.mark.parametrize("validate", (True, False))
def test_torch_calls_check_page_tables_lengths_and_boundaries_when_switched_on(torch_gpu, gpu, monkeypatch,
                                                                               validate):
    torch, ct = torch_gpu
    from cuflash import _torch_launch

    monkeypatch.setattr(_torch_launch, "_VALIDATE", validate)
    q = torch.randn(4, 8, 1, 128, dtype=torch.bfloat16)
    cache = torch.randn(64, 2, 64, 128, dtype=torch.bfloat16)
    table = torch.arange(64, dtype=torch.int32).reshape(4, 16)
    table[2, 0] = -1
    lengths = torch.tensor([100, 200, 1, 1024], dtype=torch.int32)
    _expect(validate, gpu.launches, r"page_table\[2, 0\] = -1 is outside \[0, 64\)",
            lambda: ct.attention_with_kvcache(q, cache, cache, page_table=table, seqlens_k=lengths))
    gpu.launches.clear()
    cu = torch.tensor([0, 80, 50, 128], dtype=torch.int32)
    qv = torch.randn(2, 128, 64, dtype=torch.bfloat16)
    _expect(validate, gpu.launches, r"cu_seqlens_q\[2\] = 50 is less than cu_seqlens_q\[1\] = 80",
            lambda: ct.attention_varlen(qv, qv, qv, cu, cu, 80, 80))
    gpu.launches.clear()
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    leaf = qv.clone().requires_grad_()
    o = ct.attention_varlen(leaf, leaf, leaf, cu, cu, 78, 78)
    cu.data[2] = 129  # changed between the forward and its backward (.data: past autograd's version check)
    gpu.launches.clear()
    _expect(validate, gpu.launches, r"cu_seqlens_q\[2\] = 129 is outside \[0, 128\]",
            lambda: torch.autograd.grad(o, leaf, torch.ones_like(o)))


def test_torch_skips_the_checks_while_torch_compile_traces(torch_gpu, gpu, monkeypatch):
    torch, ct = torch_gpu
    from cuflash import _torch_launch

    monkeypatch.setattr(_torch_launch, "_VALIDATE", True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, cache = torch.randn(4, 8, 1, 128, dtype=torch.bfloat16), torch.randn(64, 2, 64, 128, dtype=torch.bfloat16)
    lengths = torch.tensor([100, 200, 1, 5000], dtype=torch.int32)  # past the capacity of 1024
    ct.attention_with_kvcache(q, cache, cache, page_table=torch.zeros(4, 16, dtype=torch.int32), seqlens_k=lengths)
    assert gpu.launches
