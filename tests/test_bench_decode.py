"""CPU tests of the decode table (cuflash.bench.decode): the grid, the paged layout, the bytes
and ratios, the table's layout and footnotes from fake timings (NumPy standing in for CuPy,
the float64 reference for cuflash). Nothing here needs a GPU."""

import contextlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cpu_fakes import NumpyAsCupy
from cuflash import reference as ref
from cuflash.bench import common, decode

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_default_grid_covers_the_issue():
    grid = decode.DEFAULT_GRID
    batches = [b for b, _ in grid.cases]
    lengths = [n for _, n in grid.cases]
    assert min(batches) == 1 and max(batches) == 128
    assert min(lengths) == 1024 and max(lengths) == 131072
    assert set(grid.heads) == {(32, 8), (32, 1)} and set(grid.hdims) == {64, 128}
    assert grid.page_sizes == (16, 64, 256) and grid.layouts() == (None, 16, 64, 256)
    assert len(grid.shapes()) == len(grid.cases) * 2 * 2
    assert decode.count_steps(grid) == len(grid.shapes()) * 10  # dense, 3 page sizes, SDPA; eager and graph
    assert max(b * n for b, n in grid.cases) <= 2**20  # K and V of one set fit in a few GiB


def test_grid_rejects_lengths_that_do_not_fill_pages_and_bad_head_splits():
    with pytest.raises(ValueError, match=r"KV length 1000\): .*multiple of every page size \(16, 64\)"):
        decode.DecodeGrid(cases=((1, 1000),), page_sizes=(16, 64))
    with pytest.raises(ValueError, match="heads 32/5"):
        decode.DecodeGrid(heads=((32, 5),))


def test_kv_bytes_and_layout_names():
    # batch 8, 32768 keys, 8 k/v heads, d 128, bf16: K and V are 2 x 512 MiB
    assert decode.kv_bytes(8, 32768, 8, 128, 2) == 2**30
    assert decode.kv_bytes(1, 1, 1, 8, 4) == 64
    assert decode.layout_name(None) == "dense" and decode.layout_name(64) == "paged 64"


@pytest.mark.parametrize("page_size", (1, 4, 16))
def test_paged_cache_holds_each_sequence_in_its_table_order(page_size):
    rng = np.random.default_rng()
    batch, heads, n, d = 3, 2, 32, 8
    k = rng.standard_normal((batch, heads, n, d))
    slots = decode.page_slots(batch * n // page_size, seed=int(rng.integers(1 << 30)))
    cache = decode.paged_cache(k, page_size, slots, np.asarray)
    table = decode.page_table_of(slots, batch)
    assert cache.shape == (batch * n // page_size, heads, page_size, d)
    assert table.dtype == np.int32 and table.shape == (batch, n // page_size)
    assert sorted(table.ravel()) == list(range(cache.shape[0]))  # every page once
    for b in range(batch):
        gathered = np.concatenate([cache[p] for p in table[b]], axis=1)  # (heads, n, d)
        np.testing.assert_array_equal(gathered, k[b])


def test_paged_cache_of_torch_tensors():
    torch = pytest.importorskip("torch")
    k = torch.randn(2, 3, 64, 8)
    slots = decode.page_slots(2 * 64 // 16)
    cache = decode.paged_cache(k, 16, slots, torch.as_tensor)
    table = decode.page_table_of(slots, 2)
    for b in range(2):
        gathered = torch.cat([cache[int(p)] for p in table[b]], dim=1)
        assert torch.equal(gathered, k[b])


def test_accepts_keyword():
    assert decode.accepts_keyword(lambda q, *, page_table=None: q, "page_table")
    assert decode.accepts_keyword(lambda q, **kw: q, "page_table")
    assert not decode.accepts_keyword(lambda q, *, causal=False: q, "page_table")
    assert decode.is_missing_paging(TypeError("attention() got an unexpected keyword argument 'page_table'"))
    assert not decode.is_missing_paging(ValueError("page_table out of range"))


# ---- the table from fake timings -------------------------------------------------------------

SMALL = decode.DecodeGrid(cases=((2, 64), (1, 128)), heads=((4, 2),), hdims=(8,), page_sizes=(16, 32))


def reference_o(q, k, v):
    """cuflash's o, from the float64 reference (grouped heads broadcast as cuflash does)."""
    return ref.standard_attention(q, k, v).o


def gather_pages(cache, page_table, seqlens):
    """The dense (batch, Hk, N, d) a paged cache stands for."""
    return np.stack([np.concatenate([cache[p] for p in row], axis=1)[:, :n]
                     for row, n in zip(page_table, seqlens)])


@pytest.fixture
def fake_env(monkeypatch):
    rng = np.random.default_rng()
    monkeypatch.setattr(common, "random_tensor", lambda env, shape: rng.standard_normal(shape, dtype=np.float32))
    return types.SimpleNamespace(cupy=NumpyAsCupy(), torch=None, torch_reason="no torch here",
                                 dtype_name="float32", l2_bytes=10**4, free_memory=lambda: None)


@pytest.fixture
def fake_timing(monkeypatch):
    """time_call returns a time per kind of call (dense 2 ms, paged 2.5 ms) and runs it once."""
    calls = []

    def fake_time_call(cupy, fn, input_sets, warmup, repeats):
        calls.append((fn.kind, len(input_sets)))
        return [fn.ms] * 3, fn(*input_sets[0])

    def timed(kind, ms, fn):
        fn.kind, fn.ms = kind, ms
        return fn

    def paged(q, k_cache, v_cache, page_table, seqlens_k):
        return reference_o(q, gather_pages(k_cache, page_table, seqlens_k),
                           gather_pages(v_cache, page_table, seqlens_k))

    monkeypatch.setattr(decode, "time_call", fake_time_call)
    monkeypatch.setattr(decode, "cuflash_dense_fn", lambda: timed("dense", 2.0, reference_o))
    monkeypatch.setattr(decode, "cuflash_paged_fn", lambda: timed("paged", 2.5, paged))
    return calls


def test_decode_table_records_bytes_checks_and_missing_sdpa(fake_env, fake_timing):
    args = types.SimpleNamespace(warmup=1, repeats=3, tablefmt="github")
    lines = []
    progress = types.SimpleNamespace(start=lambda label: None, advance=lambda: lines.append("+"),
                                     note=lines.append)
    records = decode.decode_table(fake_env, args, progress, grid=SMALL)
    assert [(r["batch"], r["kv_len"], r["layout"], r["page_size"]) for r in records] == [
        (2, 64, "dense", None), (2, 64, "paged", 16), (2, 64, "paged", 32),
        (1, 128, "dense", None), (1, 128, "paged", 16), (1, 128, "paged", 32)]
    assert lines.count("+") == decode.count_steps(SMALL)
    first = records[0]
    assert first["kv_bytes"] == 2 * 2 * 2 * 64 * 8 * 4
    assert first["backends"]["cuflash"]["gbps"] == pytest.approx(first["kv_bytes"] / 2e-3 / 1e9)
    assert first["backends"]["sdpa"]["status"] == "unavailable"
    for r in records[1:3] + records[4:]:  # the paged caches hold exactly the dense keys
        assert r["max_abs_diff_vs_dense"] == 0.0
        assert r["backends"]["cuflash"]["ms"] == 2.5
    set_bytes = first["kv_bytes"] + 2 * 4 * 8 * 4
    assert fake_timing[0] == ("dense", common.num_input_sets(set_bytes, fake_env.l2_bytes))
    assert decode.cuflash_failures(records) == []


def _records(sdpa_ms=4.0, paged_error=None):
    """One dense and two paged rows of 32/8 heads, d 128, with the given SDPA time."""
    nbytes = decode.kv_bytes(8, 32768, 8, 128, 2)
    base = {"table": "decode", "batch": 8, "kv_len": 32768, "heads_q": 32, "heads_kv": 8,
            "hdim": 128, "dtype": "bfloat16", "kv_bytes": nbytes}
    ok = lambda ms: decode._entry(ms, times=[ms], nbytes=nbytes)  # noqa: E731
    sdpa = (ok(sdpa_ms) if sdpa_ms else
            decode._entry(status="unavailable", error="PyTorch 2.13 sees no CUDA device"))
    failed = decode._entry(status="error", error=paged_error) if paged_error else ok(0.5)
    return [{**base, "layout": "dense", "page_size": None, "backends": {"cuflash": ok(0.4), "sdpa": sdpa}},
            {**base, "layout": "paged", "page_size": 16, "backends": {"cuflash": failed}},
            {**base, "layout": "paged", "page_size": 256,
             "backends": {"cuflash": decode._entry(status="unavailable", error=decode.NOT_IN_BUILD)}}]


def test_decode_table_layout_ratios_and_ceiling_share():
    args = types.SimpleNamespace(tablefmt="github")
    text = decode.format_decode(_records(), args, {"copy_gbps": 4000.0}, common.Footnotes())
    assert "32 query heads over 8 k/v heads (GQA), head dim 128, bfloat16" in text
    rows = [line for line in text.splitlines() if line.startswith("|") and "8 x 32768" in line]
    dense_row, paged_row, missing_row = rows
    cells = [c.strip() for c in dense_row.strip("|").split("|")]
    # 1 GiB in 0.4 ms = 2684 GB/s = 67% of 4000; SDPA 4 ms: 268 GB/s, cuflash 10x faster
    assert cells == ["8 x 32768", "dense", "0.400", "2684", "67%", "4.000", "268", "10.00x", ""]
    cells = [c.strip() for c in paged_row.strip("|").split("|")]
    assert cells == ["8 x 32768", "paged 16", "0.500", "2147", "54%", "", "", "8.00x", "0.80x"]
    assert f"{common.DASH} [1]" in missing_row and f"[1] {decode.NOT_IN_BUILD}" in text
    assert "4000 GB/s, bytes read + written" in " ".join(text.split()) and "enable_gqa=True" in text
    width = max(len(line) for line in text.splitlines())
    assert width <= common.CAPTION_WIDTH, f"the report is {width} columns wide"


def test_decode_table_footnotes_for_failures_and_missing_peers():
    args = types.SimpleNamespace(tablefmt="github")
    records = _records(sdpa_ms=None, paged_error="RuntimeError: boom")
    notes = common.Footnotes()
    text = decode.format_decode(records, args, None, notes)
    assert "FAILED [2]" in text and "[2] cuflash paged 16: RuntimeError: boom" in text  # [1]: SDPA's
    assert "PyTorch SDPA columns: PyTorch 2.13 sees no CUDA device" in text
    assert "not measured" in text  # no copy ceiling given
    assert decode.cuflash_failures(records) == [
        ("decode 32/8 heads hdim 128 batch 8 KV 32768 paged 16: cuflash", "RuntimeError: boom")]


def test_paged_call_without_paging_is_a_footnote_not_a_failure(fake_env, fake_timing, monkeypatch):
    def old_attention(q, k_cache, v_cache, page_table, seqlens_k):
        raise TypeError("attention() got an unexpected keyword argument 'page_table'")

    old_attention.kind, old_attention.ms = "paged", 1.0
    monkeypatch.setattr(decode, "cuflash_paged_fn", lambda: old_attention)
    args = types.SimpleNamespace(warmup=1, repeats=3, tablefmt="github")
    records = decode.decode_table(fake_env, args, "[test]", grid=SMALL)
    paged = [r for r in records if r["layout"] == "paged"]
    assert all(r["backends"]["cuflash"]["status"] == "unavailable" for r in paged)
    assert decode.cuflash_failures(records) == []
    text = decode.format_decode(records, args, {"copy_gbps": 100.0}, common.Footnotes())
    assert decode.NOT_IN_BUILD in text


def test_import_needs_no_cupy():
    code = "import sys, cuflash.bench.decode; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


class _FakeTorchCuda:
    """torch.cuda as _time_graph uses it: calls made under ``graph`` are recorded into the
    graph, and each timed replay (between two events) takes ``replay_ms``."""

    def __init__(self, replay_ms):
        self.replay_ms, self.capturing = replay_ms, None

    class Stream:
        def wait_stream(self, other):
            pass

    def current_stream(self):
        return self.Stream()

    def stream(self, stream):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def graph(self, graph):
        self.capturing = graph
        yield
        self.capturing = None

    def CUDAGraph(self):
        return types.SimpleNamespace(replay=lambda: None)

    def Event(self, enable_timing):
        cuda = self

        class _Event:
            def record(self):
                pass

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.replay_ms

        return _Event()


def test_graph_timing_captures_the_calls_in_turn_and_divides_a_replay():
    cuda = _FakeTorchCuda(replay_ms=4.0)
    calls = []
    env = types.SimpleNamespace(torch=types.SimpleNamespace(cuda=cuda), free_memory=lambda: None)

    def fn(q, k, v):
        calls.append((q, cuda.capturing is not None))

    sets = [(i, None, None) for i in range(3)]
    entry = decode._time_graph(env, fn, sets, nbytes=10**9)
    # two warm-up calls on a side stream, then GRAPH_CALLS captured, the sets in turn
    assert calls[:2] == [(0, False), (1, False)]
    assert calls[2:] == [(i % 3, True) for i in range(decode.GRAPH_CALLS)]
    assert entry["ms"] == pytest.approx(4.0 / decode.GRAPH_CALLS)
    assert len(entry["times_ms"]) == decode.GRAPH_REPLAYS
    assert entry["gbps"] == pytest.approx(10**9 / (entry["ms"] * 1e-3) / 1e9)
    missing = decode._time_graph(types.SimpleNamespace(torch=None, torch_reason="no torch"), fn, sets, 1)
    assert missing["status"] == "unavailable" and missing["error"] == "no torch"


def test_graph_table_follows_the_eager_one_where_graphs_were_measured():
    args = types.SimpleNamespace(tablefmt="github")
    records = _records()
    eager_only = decode.format_decode(records, args, {"copy_gbps": 4000.0}, common.Footnotes())
    assert f"{decode.GRAPH_CALLS} calls a CUDA graph" not in eager_only  # no graph entries: one table
    unmeasured = decode._entry(status="unavailable", error="no torch")
    for r in records:
        r["graph"] = {"cuflash": unmeasured}
    assert decode.format_decode(records, args, {"copy_gbps": 4000.0}, common.Footnotes()) == eager_only
    nbytes = records[0]["kv_bytes"]
    records[0]["graph"] = {"cuflash": decode._entry(0.3, nbytes=nbytes), "sdpa": decode._entry(0.36, nbytes=nbytes)}
    records[1]["graph"] = {"cuflash": decode._entry(status="error", error="RuntimeError: capture")}
    records[2]["graph"] = {"cuflash": decode._entry(0.6, nbytes=nbytes)}
    text = decode.format_decode(records, args, {"copy_gbps": 4000.0}, common.Footnotes())
    graph_part = text.split(f"{decode.GRAPH_CALLS} calls a CUDA graph")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in graph_part.splitlines()
            if line.startswith("|") and "8 x 32768" in line]
    # 1 GiB in 0.3 ms = 3579 GB/s = 89% of 4000; SDPA's graph 0.36 ms: 1.20x
    assert rows[0] == ["8 x 32768", "dense", "0.300", "3579", "89%", "0.360", "2983", "1.20x", ""]
    assert rows[1][2].startswith("FAILED") and "cuflash paged 16 in a CUDA graph: RuntimeError: capture" in text
    assert rows[2][2:5] == ["0.600", "1790", "45%"] and rows[2][-1] == "0.50x"
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    assert decode.cuflash_failures(records) == [
        ("decode 32/8 heads hdim 128 batch 8 KV 32768 paged 16 in a CUDA graph: cuflash", "RuntimeError: capture")]
