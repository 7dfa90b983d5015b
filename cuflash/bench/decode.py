"""The decode table: one query token per sequence against a KV cache, the inner loop of LLM
serving, where the time is spent reading K and V.

Shapes (:class:`DecodeGrid`): q (batch, Hq, 1, d) against K and V of ``KV length`` keys per
sequence, every sequence the same length, for each (batch, KV length) case, each head split
(32 query heads over 8 k/v heads, GQA, and over 1, MQA) and head dim; random normal inputs in
the benchmark dtype. Each case runs with the cache

- ``dense``: k, v of shape (batch, Hk, N, d): ``cuflash.torch.attention(q, k, v)`` on torch
  tensors (outside autograd it routes one query a head to the split-KV kernels), or
  ``cuflash.attention(q, k, v)`` on CuPy arrays where torch is missing;
- ``paged P``: caches of shape (num_pages, Hk, P, d) holding the same keys and values in pages of
  P tokens, placed in a random order, with an int32 page table (batch, N / P) and int32
  ``seqlens_k`` (batch,): ``attention(q, k_cache, v_cache, page_table=..., seqlens_k=...)``, the
  same entry point.
  A build without that argument shows a dash with a footnote.

The peer is PyTorch SDPA, ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on the
dense tensors (it has no paged form). GB/s counts the bytes of K and V a call must read
(2 * batch * Hk * N * d * itemsize) over its time; the copy ceiling is the device-to-device
copy of :func:`cuflash.bench.common.measure_ceilings` (bytes read + written / time), measured
once per run. Timing, warm-up and input rotation past the L2 cache are the speed table's
(:func:`cuflash.bench.common.time_call`): whole eager calls, host time included, which at
batch 1 and short caches is most of a call. Serving engines capture their decode step in a CUDA
graph instead, so each call is timed that way too (with torch): GRAPH_CALLS calls over the
input sets in turn captured in one ``torch.cuda.graph`` and replayed, the GPU's time a call.

Importing this module needs neither a GPU nor CuPy.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import statistics
import textwrap
from typing import Callable, Optional

from . import common
from .common import DASH, Footnotes, time_call

# (batch, KV length): batch 1 over the whole length range, the batch sizes of serving at the
# lengths they run, at most 2^20 cached tokens (4 GiB of K and V at Hk 8, d 128, bf16).
DEFAULT_CASES = ((1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192),
                 (64, 4096), (128, 1024), (128, 8192))
DEFAULT_HEADS = ((32, 8), (32, 1))  # (query heads, k/v heads): GQA and MQA
DEFAULT_HDIMS = (64, 128)
DEFAULT_PAGE_SIZES = (16, 64, 256)
PAGE_ORDER_SEED = 0  # the pages' places in the cache: a fixed random permutation
NOT_IN_BUILD = "paged KV caches (page_table=, seqlens_k=) not in this build"
SDPA = "sdpa"
GRAPH_CALLS = 20  # decode calls captured in one CUDA graph (the input sets in turn)
GRAPH_REPLAYS = 10  # timed replays of it; the median a call is reported


@dataclasses.dataclass(frozen=True)
class DecodeGrid:
    """What the table measures: every case x head split x head dim, dense and each page size."""

    cases: tuple = DEFAULT_CASES
    heads: tuple = DEFAULT_HEADS
    hdims: tuple = DEFAULT_HDIMS
    page_sizes: tuple = DEFAULT_PAGE_SIZES

    def __post_init__(self):
        for batch, kv_len in self.cases:
            ragged = [p for p in self.page_sizes if kv_len % p]
            if batch < 1 or kv_len < 1 or ragged:
                raise ValueError(f"decode case (batch {batch}, KV length {kv_len}): both must be "
                                 f"positive and the length a multiple of every page size "
                                 f"{self.page_sizes}")
        for hq, hk in self.heads:
            if hk < 1 or hq % hk:
                raise ValueError(f"decode heads {hq}/{hk}: the query heads must be a multiple of "
                                 f"the k/v heads")

    def shapes(self) -> list:
        """(batch, KV length, Hq, Hk, d) in table order: head split, head dim, case."""
        return [(b, n, hq, hk, d) for (hq, hk), d, (b, n) in
                itertools.product(self.heads, self.hdims, self.cases)]

    def layouts(self) -> tuple:
        """None (the dense cache), then each page size."""
        return (None,) + tuple(self.page_sizes)


DEFAULT_GRID = DecodeGrid()


# ---- pure helpers (no GPU) ---------------------------------------------------------------


def kv_bytes(batch: int, kv_len: int, heads_kv: int, hdim: int, itemsize: int) -> int:
    """Bytes of K and V one decode call reads."""
    return 2 * batch * heads_kv * kv_len * hdim * itemsize


def layout_name(page_size: Optional[int]) -> str:
    return "dense" if page_size is None else f"paged {page_size}"


def count_steps(grid: DecodeGrid = DEFAULT_GRID) -> int:
    """Measurements: per shape, cuflash on every layout and SDPA once, eagerly and in a CUDA graph."""
    return 2 * len(grid.shapes()) * (len(grid.layouts()) + 1)


def page_slots(num_pages: int, seed: int = PAGE_ORDER_SEED):
    """slots[g]: where logical page g (sequence g // pages_per_sequence) lies in the cache."""
    import numpy as np

    return np.random.default_rng(seed).permutation(num_pages)


def paged_cache(x, page_size: int, slots, to_index: Callable):
    """x (batch, Hk, N, d) laid out as a cache (num_pages, Hk, page_size, d), logical page g at
    ``slots[g]``. to_index makes an index array of x's framework from a NumPy one."""
    import numpy as np

    batch, heads, n, d = x.shape
    pages = x.reshape(batch, heads, n // page_size, page_size, d).swapaxes(1, 2)
    pages = pages.reshape(batch * (n // page_size), heads, page_size, d)
    return pages[to_index(np.argsort(slots))]  # cache[slots[g]] = pages[g]


def page_table_of(slots, batch: int):
    """The int32 page table (batch, pages per sequence) of :func:`paged_cache`'s layout."""
    import numpy as np

    return np.asarray(slots, dtype=np.int32).reshape(batch, -1)


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether fn takes the keyword argument ``name`` (True when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def is_missing_paging(exc: BaseException) -> bool:
    return isinstance(exc, TypeError) and ("page_table" in str(exc) or "seqlens_k" in str(exc))


# ---- the calls timed ---------------------------------------------------------------------


def _framework_attention(q) -> Callable:
    """The cuflash entry point a user with these inputs calls: cuflash.torch.attention on torch
    tensors (cuflash.attention would take them through zero-copy views made on every call),
    and cuflash.attention (its o) on CuPy arrays."""
    import cuflash
    from cuflash import _views

    if _views.is_cuda_tensor(q):
        import cuflash.torch

        return cuflash.torch.attention
    return lambda *args, **kwargs: cuflash.attention(*args, **kwargs).o


def cuflash_dense_fn() -> Callable:
    calls = {}

    def call(q, k, v):
        attend = calls.get(type(q)) or calls.setdefault(type(q), _framework_attention(q))
        return attend(q, k, v)
    return call


def cuflash_paged_fn() -> Optional[Callable]:
    """The paged call, or None when this build's cuflash.attention has no page_table."""
    import cuflash

    if not accepts_keyword(cuflash.attention, "page_table"):
        return None
    calls = {}

    def call(q, k_cache, v_cache, page_table, seqlens_k):
        attend = calls.get(type(q)) or calls.setdefault(type(q), _framework_attention(q))
        return attend(q, k_cache, v_cache, page_table=page_table, seqlens_k=seqlens_k)
    return call


def sdpa_fn(env) -> Callable:
    sdpa = env.torch.nn.functional.scaled_dot_product_attention
    return lambda q, k, v: sdpa(q, k, v, enable_gqa=True)


# ---- measurement -------------------------------------------------------------------------


def _entry(ms=None, status="ok", error=None, times=None, nbytes=0) -> dict:
    return {"ms": ms, "status": status, "error": error, "times_ms": times or [],
            "gbps": nbytes / (ms * 1e-3) / 1e9 if ms else None}


def _time(env, args, fn, sets, nbytes: int):
    """(entry, first output) of fn over the input sets; a failure becomes the entry."""
    try:
        times, out = time_call(env.cupy, fn, sets, args.warmup, args.repeats)
        return _entry(statistics.median(times), times=times, nbytes=nbytes), out
    except Exception as exc:
        if is_missing_paging(exc):
            failed = _entry(status="unavailable", error=NOT_IN_BUILD)
        else:
            failed = _entry(status="oom" if common.is_oom(env, exc) else "error",
                            error=common.first_line(exc))
    env.free_memory()  # after the except block, whose traceback held the failed call's arrays
    return failed, None


def _time_graph(env, fn, sets, nbytes: int) -> dict:
    """The entry of fn timed in a CUDA graph: GRAPH_CALLS calls over the input sets in turn
    captured once (after two calls on a side stream, as capture wants), then GRAPH_REPLAYS
    replays between events; ms is the median replay / GRAPH_CALLS. Needs torch."""
    torch = env.torch
    if torch is None:
        return _entry(status="unavailable", error=env.torch_reason)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(2):
                fn(*sets[i % len(sets)])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(GRAPH_CALLS):
                fn(*sets[i % len(sets)])
        graph.replay()
        times = []
        for _ in range(GRAPH_REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / GRAPH_CALLS)
        del graph
        return _entry(statistics.median(times), times=times, nbytes=nbytes)
    except Exception as exc:
        failed = _entry(status="oom" if common.is_oom(env, exc) else "error", error=common.first_line(exc))
    env.free_memory()  # after the except block, whose traceback held the graph and its outputs
    return failed


def _index_maker(env) -> Callable:
    """NumPy int arrays -> index / argument arrays of the inputs' framework, on the GPU."""
    if env.torch is not None:
        return lambda a: env.torch.as_tensor(a, device="cuda")
    return env.cupy.asarray


def _max_abs_diff(env, a, b) -> Optional[float]:
    from .speed import max_abs_diff

    return None if a is None or b is None else max_abs_diff(env, a, b)


def decode_table(env, args, progress=None, grid: DecodeGrid = DEFAULT_GRID) -> list:
    """Every shape of the grid, dense and paged, against SDPA; returns one record per row.

    args: warmup and repeats (as for the other tables). progress: a common.Progress, or a
    string that prefixes plain log lines."""
    progress = common.as_progress(progress)
    records = []
    for shape in grid.shapes():
        records += _run_shape(env, args, shape, grid, progress)
        env.free_memory()
    return records


def _run_shape(env, args, shape: tuple, grid: DecodeGrid, progress) -> list:
    import numpy as np

    batch, kv_len, hq, hk, d = shape
    itemsize = common.ITEMSIZE.get(env.dtype_name, 2)
    nbytes = kv_bytes(batch, kv_len, hk, d, itemsize)
    count = common.num_input_sets(nbytes + batch * hq * d * itemsize, env.l2_bytes)
    sets = [(common.random_tensor(env, (batch, hq, 1, d)), common.random_tensor(env, (batch, hk, kv_len, d)),
             common.random_tensor(env, (batch, hk, kv_len, d))) for _ in range(count)]
    to_index = _index_maker(env)
    label = f"decode {env.dtype_name} {hq}/{hk} heads hdim {d} batch {batch} KV {kv_len}"
    base = {"table": "decode", "batch": batch, "kv_len": kv_len, "heads_q": hq, "heads_kv": hk,
            "hdim": d, "dtype": env.dtype_name, "kv_bytes": nbytes}

    def report(name: str, entry: dict, check: str = "") -> None:
        progress.advance()
        progress.note(f"{label} {name:>16}: " + (
            f"{entry['ms']:.3f} ms {entry['gbps']:.0f} GB/s{check}" if entry["ms"] is not None
            else f"{entry['status']}: {entry['error']}"))

    def in_graph(name: str, fn, inputs) -> dict:
        progress.start(f"{label}: {name} in a CUDA graph")
        entry = _time_graph(env, fn, inputs, nbytes)
        report(f"{name} graph", entry)
        return entry

    progress.start(f"{label}: cuflash dense")
    dense, dense_out = _time(env, args, cuflash_dense_fn(), sets, nbytes)
    report("dense", dense)
    progress.start(f"{label}: SDPA")
    if env.torch is None:
        sdpa, sdpa_out = _entry(status="unavailable", error=env.torch_reason), None
    else:
        sdpa, sdpa_out = _time(env, args, sdpa_fn(env), sets, nbytes)
    sdpa_diff = _max_abs_diff(env, dense_out, sdpa_out)
    report("SDPA", sdpa, "" if sdpa_diff is None else f", max|o - o_cuflash| = {sdpa_diff:.2e}")
    del sdpa_out
    graphs = {"cuflash": in_graph("dense", cuflash_dense_fn(), sets)}
    graphs[SDPA] = in_graph("SDPA", sdpa_fn(env) if env.torch is not None else None, sets)
    records = [{**base, "layout": "dense", "page_size": None,
                "backends": {"cuflash": dense, SDPA: sdpa}, "graph": graphs, "max_abs_diff_vs_cuflash": sdpa_diff}]

    seqlens = to_index(np.full(batch, kv_len, dtype=np.int32))
    for page_size in grid.page_sizes:
        progress.start(f"{label}: cuflash paged {page_size}")
        fn = cuflash_paged_fn()
        diff = None
        if fn is None:
            entry = graph = _entry(status="unavailable", error=NOT_IN_BUILD)
            report(layout_name(page_size), entry)
            report(f"{layout_name(page_size)} graph", graph)
        else:
            slots = page_slots(batch * kv_len // page_size)
            table = to_index(page_table_of(slots, batch))
            paged_sets = [(q, paged_cache(k, page_size, slots, to_index),
                           paged_cache(v, page_size, slots, to_index), table, seqlens) for q, k, v in sets]
            entry, out = _time(env, args, fn, paged_sets, nbytes)
            diff = _max_abs_diff(env, dense_out, out)
            report(layout_name(page_size), entry, "" if diff is None else f", max|o - o_dense| = {diff:.2e}")
            del out
            graph = in_graph(layout_name(page_size), fn, paged_sets)
            del paged_sets
            env.free_memory()
        records.append({**base, "layout": "paged", "page_size": page_size,
                        "backends": {"cuflash": entry}, "graph": {"cuflash": graph}, "max_abs_diff_vs_dense": diff})
    del sets, dense_out
    return records


def cuflash_failures(records: list) -> list:
    """(label, error) of every cuflash measurement that failed, eager or in a CUDA graph (a
    build without paging is not a failure)."""
    return [(f"decode {r['heads_q']}/{r['heads_kv']} heads hdim {r['hdim']} batch {r['batch']} "
             f"KV {r['kv_len']} {layout_name(r['page_size'])}{where}: cuflash", entry["error"])
            for r in records for where, entry in (("", r["backends"]["cuflash"]),
                                                  (" in a CUDA graph", r.get("graph", {}).get("cuflash")))
            if entry is not None and entry["status"] in ("error", "oom")]


def json_settings(grid: DecodeGrid = DEFAULT_GRID) -> dict:
    return {"cases": [list(c) for c in grid.cases], "heads": [list(h) for h in grid.heads],
            "hdims": list(grid.hdims), "page_sizes": list(grid.page_sizes),
            "page_order_seed": PAGE_ORDER_SEED}


# ---- report ------------------------------------------------------------------------------


def _cells(entry: Optional[dict], notes: Footnotes, name: str, layout: str) -> list:
    """[ms, GB/s] of one measurement; a missing one is a dash (cuflash's failure FAILED), its
    reason a footnote."""
    if entry is None:
        return [DASH, DASH]
    if entry["ms"] is not None:
        return [f"{entry['ms']:.3f}", f"{entry['gbps']:.0f}"]
    if entry["status"] == "oom":
        return ["OOM", "OOM"]
    if entry["status"] == "unavailable":
        what = str(entry["error"]) if name == "cuflash" else f"PyTorch SDPA columns: {entry['error']}"
        return [f"{DASH} {notes.mark(what)}", DASH]
    if name == "cuflash":
        return [f"FAILED {notes.mark(f'cuflash {layout}: ' + str(entry['error']))}", DASH]
    return [f"{DASH} {notes.mark('SDPA: ' + str(entry['error']))}", DASH]


def _copy_share(entry: Optional[dict], copy_gbps: Optional[float]) -> str:
    """An entry's GB/s as a share of the copy ceiling, e.g. '97%'; a dash when either is missing."""
    gbps = entry.get("gbps") if entry else None
    return f"{100 * gbps / copy_gbps:.0f}%" if gbps and copy_gbps else DASH


def _speed_ratio(slower: Optional[dict], faster: Optional[dict]) -> str:
    """slower's time / faster's time, e.g. '2.50x'; a dash when either is missing."""
    if not slower or not faster or slower.get("ms") is None or faster.get("ms") is None:
        return DASH
    return f"{slower['ms'] / faster['ms']:.2f}x"


def format_decode(records: list, args, ceilings: Optional[dict], notes: Footnotes) -> str:
    """Two tables per (head split, head dim, dtype), eager calls and the same calls in a CUDA
    graph (where measured); a row per case and cache layout."""
    from tabulate import tabulate

    copy_gbps = (ceilings or {}).get("copy_gbps")
    # cuflash's columns go unnamed (ms, GB/s) so that the table fits common.CAPTION_WIDTH
    headers = ["batch x KV", "cache", "ms", "GB/s", "% of copy", "SDPA ms", "SDPA GB/s", "vs SDPA", "vs dense"]
    groups = dict.fromkeys((r["heads_q"], r["heads_kv"], r["hdim"], r["dtype"]) for r in records)
    blocks = []
    for (hq, hk, d, dtype), graph in itertools.product(groups, (False, True)):
        measured = "graph" if graph else "backends"  # the record's entries this table shows
        mine_of = [r for r in records if (r["heads_q"], r["heads_kv"], r["hdim"], r["dtype"]) == (hq, hk, d, dtype)]
        if graph and all(e["status"] == "unavailable" for r in mine_of for e in r.get(measured, {}).values()):
            continue  # not measured (no torch): no table
        rows = []
        dense_of = {}  # (batch, KV length) -> the dense record
        for r in mine_of:
            key = (r["batch"], r["kv_len"])
            if r["page_size"] is None:
                dense_of[key] = r
            dense = dense_of.get(key)
            layout = layout_name(r["page_size"]) + (" in a CUDA graph" if graph else "")
            mine = r.get(measured, {}).get("cuflash")
            sdpa = dense.get(measured, {}).get(SDPA) if dense else None
            sdpa_cells = _cells(sdpa, notes, SDPA, layout) if r["page_size"] is None else ["", ""]
            paged = (_speed_ratio(dense.get(measured, {}).get("cuflash") if dense else None, mine)
                     if r["page_size"] is not None else "")
            rows.append([f"{r['batch']} x {r['kv_len']}", layout_name(r["page_size"]),
                         *_cells(mine, notes, "cuflash", layout), _copy_share(mine, copy_gbps), *sdpa_cells,
                         _speed_ratio(sdpa, mine), paged])
        kind = "MQA" if hk == 1 else "GQA"
        title = (f"decode (cuflash){f', {GRAPH_CALLS} calls a CUDA graph' if graph else ''}, 1 query token per "
                 f"sequence: {hq} query heads over {hk} k/v head{'s' if hk > 1 else ''} ({kind}), head dim {d}, "
                 f"{dtype}")
        table = tabulate(rows, headers, tablefmt=getattr(args, "tablefmt", "github"),
                         disable_numparse=True, colalign=("right", "left") + ("right",) * 7)
        blocks.append(textwrap.fill(title, common.CAPTION_WIDTH) + "\n\n" + table)
    ceiling = f"{copy_gbps:.0f} GB/s" if copy_gbps else f"{DASH} (not measured)"
    caption = ("batch x KV: sequences x keys per sequence (KV length). ms: cuflash's median time of one "
               "call; GB/s: bytes of K and V read (2 * batch * k/v heads * KV length * head dim * "
               "itemsize) / time; % of copy: cuflash GB/s / the device-to-device "
               f"copy measured at the start ({ceiling}, bytes read + written / time). dense: "
               "cuflash.torch.attention(q, k, v) (cuflash.attention on CuPy arrays without torch) with k, v "
               "(batch, k/v heads, KV length, head dim); paged "
               "P: the same keys and values in a cache (pages, k/v heads, P, head dim), pages in "
               "random order, through page_table and seqlens_k. SDPA: "
               "F.scaled_dot_product_attention(q, k, v, enable_gqa=True) on the dense tensors; it "
               "has no paged form, so its columns stand on the dense row, and a paged row's vs SDPA "
               "compares with that time. vs SDPA: SDPA time / cuflash time; vs dense: cuflash's "
               "dense time / its paged time. The first table of a head split times whole eager "
               f"calls, host time included; the second the same calls (SDPA's too) captured {GRAPH_CALLS} "
               "to a torch CUDA graph, the input sets in turn, as serving engines run their decode "
               f"step: ms is the median of {GRAPH_REPLAYS} replays / {GRAPH_CALLS}, the GPU's time a call.")
    lines = [textwrap.fill(caption, common.CAPTION_WIDTH)] + [
        textwrap.fill(line, common.CAPTION_WIDTH, subsequent_indent="    ") for line in notes.lines()]
    return "\n\n".join(blocks) + "\n\n" + "\n".join(lines)
