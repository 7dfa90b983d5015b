"""The case matrix scripts/sanitize.sh runs under compute-sanitizer: every kernel variant the
dispatcher can pick, at small sizes.

    python scripts/sanitize_cases.py [--subset all|one] [--seed N] [--shard K/N] [--launched FILE]
    python scripts/sanitize_cases.py --coverage FILE [FILE ...]

Per case: the forward, then the backward (preprocess, key passes, dQ) with atomic and with
deterministic dQ. Inputs are strided views (a (B, N, H, d) buffer seen as (B, H, N, d)) with
broadcast or grouped heads and odd lengths, so tile edges, padded head dims and the batch
offset arithmetic are all exercised.

``--subset all`` (memcheck, initcheck): each dtype x head dims 32..256 (every bucket, plus 40
and d != dv), causal with Nq < Nk and Nq > Nk (rows without keys), and block-sparse and
windowed cases when cuflash.attention takes them. ``--subset one`` (racecheck, synccheck, which
are slow): one case per variant. Both subsets hold, per 16-bit dtype, a case of 300 slices
(MANY_ITEMS) whose persistent key pass walks several items a CTA.

Decoding (cuflash._api.decode_attention): every variant, dense and paged (vLLM's layout as a view), split and
not, with lengths past the capacity and page-table entries outside [0, num_pages), which the
kernels must clamp and mask without reading out of bounds.

CuPy's memory pool is switched off, so every array is its own cudaMalloc: a read past the end
of an input, or of an output never written (initcheck), is caught instead of landing in a
neighbour's block. The last line says how many of ``_config.all_variants()`` (for this GPU)
ran.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_util import random_array, tma_refused  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _config, _constants, _loader, _tiles, masks  # noqa: E402

ODD_LENGTHS = (77, 131)
# Enough (key tile, slice) items that the persistent wgmma key pass (head dim 64, not causal)
# walks several a CTA: 3 x 100 slices of 3 key tiles (300 keys) are 900, ~7 a CTA on 132 SMs,
# so each of its two K, V buffers is refilled and its barriers' phases turn over.
MANY_ITEMS = (3, 100, 100)
LONG_QUERIES = 1100  # past the 1024 rows up to which the wgmma forward runs a persistent grid


class Case(NamedTuple):
    dtype: str
    d: int
    dv: int
    nq: int
    nk: int
    causal: bool
    sparse: Optional[str] = None  # None, "block", "window" or "block+window"
    slices: Optional[tuple] = None  # (batch, query heads, k/v heads); None: run_case's


def _mask_support():
    params = inspect.signature(cuflash.attention).parameters
    return "block_mask" in params, "window" in params


def cases(subset):
    """The case list; ``one`` keeps one case per variant (d = the bucket)."""
    short, long = ODD_LENGTHS
    out = []
    for dtype in _constants.SUPPORTED_DTYPES:
        dims = _tiles.HEAD_DIM_BUCKETS if dtype != "float32" else range(32, _constants.MAX_HEAD_DIM + 1, 32)
        for d in dims:
            out.append(Case(dtype, d, d, short, long, False))
            out.append(Case(dtype, d, d, long, short, True))  # rows 0..53 see no key
            if subset == "all":
                out.append(Case(dtype, d, d, short, long, True))
        if dtype != "float32":
            out.append(Case(dtype, 64, 64, short, 300, False, slices=MANY_ITEMS))
        if subset == "all":
            out += [Case(dtype, 40, 40, long, short, c) for c in (False, True)]
            out += [Case(dtype, 64, 128, short, long, c) for c in (False, True)]
            out += [Case(dtype, 128, 40, long, short, c) for c in (False, True)]
    has_block_mask, has_window = _mask_support()
    kinds = (["block"] if has_block_mask else []) + (["window"] if has_window else [])
    if has_block_mask and has_window:
        kinds.append("block+window")
    for kind in kinds:
        for dtype in _constants.SUPPORTED_DTYPES:
            # A block mask selects the SPARSE variants: every bucket, like the dense cases. A
            # window alone runs the dense variants, so two head dims do.
            if kind == "block":
                dims = _tiles.HEAD_DIM_BUCKETS if dtype != "float32" else range(32, _constants.MAX_HEAD_DIM + 1, 32)
            else:
                dims = (64, 256) if subset == "all" else (64,)
            for d in dims:
                out += [Case(dtype, d, d, short, long, False, kind), Case(dtype, d, d, long, short, True, kind)]
    return out


class DecodeCase(NamedTuple):
    dtype: str
    d: int
    heads: tuple  # (Hq, Hk)
    nq: int
    page_size: Optional[int]  # None: a dense cache
    num_splits: Optional[int]  # None: chosen


# (heads, queries): 4, 32 and 64 packed rows, so one, two and four row warps; then 4 rows of
# 3 x 240 k/v heads, a grid deep enough for the short-cache tiles (_config.decode_config)
DECODE_GROUPS = (((8, 2), 1), ((8, 1), 4), ((16, 1), 4), ((960, 240), 1))
DECODE_BATCH, DECODE_CAPACITY = 3, 300


def decode_cases(subset):
    """Decoding cases; ``one`` keeps one a variant (and its combine)."""
    out = []
    page_sizes = (None, 16, 256) if subset == "all" else (None, 64)
    splits = (1, 3, None) if subset == "all" else (3,)  # 3: the combine runs (300 keys are 3-5 tiles)
    for dtype in ("float16", "bfloat16"):
        for d in _tiles.DECODE_HEAD_DIM_BUCKETS:
            out += [DecodeCase(dtype, d, heads, nq, page_size, num_splits) for page_size in page_sizes
                    for heads, nq in DECODE_GROUPS for num_splits in splits]
    return out


def run_decode_case(case, rng, subset):
    """Three sequences against a cache of 300 keys: empty, 37 keys, and a length past the
    capacity; paged, the table also holds entries outside [0, num_pages)."""
    import cupy

    from cuflash import _api

    batch, capacity = DECODE_BATCH, DECODE_CAPACITY
    (hq, hk), d = case.heads, case.d
    q = strided(rng, batch, hq, case.nq, d, case.dtype)
    lengths = cupy.asarray(np.array([0, 37, capacity + 50], np.int32))
    if case.page_size is None:
        k, v = (strided(rng, batch, hk, capacity, d, case.dtype) for _ in range(2))
        out = _api.decode_attention(q, k, v, seqlens_k=lengths, num_splits=case.num_splits)
    else:
        max_pages = -(-capacity // case.page_size)
        num_pages = batch * max_pages
        k, v = (strided(rng, num_pages, hk, case.page_size, d, case.dtype) for _ in range(2))
        table = rng.permutation(num_pages).reshape(batch, max_pages).astype(np.int32)
        table[2, ::2] = rng.choice(np.array([-1, num_pages, 2**31 - 1, -2**31], np.int32), size=table[2, ::2].shape)
        out = _api.decode_attention(q, k, v, page_table=cupy.asarray(table), seqlens_k=lengths,
                                       num_splits=case.num_splits)
    return bool(cupy.isfinite(out.o).all()) and bool(cupy.isfinite(out.l).all())


def mask_kwargs(case, rng):
    """block_mask= / window= arguments for a sparse case (a random mask, a small window)."""
    kwargs = {}
    if "block" in case.sparse:
        bq, bk = (32, 48) if case.causal else (64, 64)
        tq, tk = -(-case.nq // bq), -(-case.nk // bk)
        kwargs["block_mask"] = masks.BlockMask.from_dense(rng.random((tq, tk)) < 0.5, (bq, bk))
    if "window" in case.sparse:
        kwargs["window"] = (23, -1 if case.causal else 9)
    return kwargs


def strided(rng, batch, heads, n, d, dtype):
    """A (batch, heads, n, d) view of a (batch, n, heads, d) device buffer."""
    import cupy

    return cupy.asarray(random_array(rng, (batch, n, heads, d), dtype)).swapaxes(1, 2)


def run_case(case, rng, subset):
    import cupy

    # all: 2 batches of 4 query heads on 2 kv heads (grouped); one: 2 heads on one kv head
    batch, hq, hkv = case.slices or ((2, 4, 2) if subset == "all" else (1, 2, 1))
    q = strided(rng, batch, hq, case.nq, case.d, case.dtype)
    k = strided(rng, batch, hkv, case.nk, case.d, case.dtype)
    v = strided(rng, batch, hkv, case.nk, case.dv, case.dtype)
    do = strided(rng, batch, hq, case.nq, case.dv, case.dtype)
    kwargs = dict(causal=case.causal, **(mask_kwargs(case, rng) if case.sparse else {}))
    out = cuflash.attention(q, k, v, **kwargs)
    results = [out.o]
    for deterministic in (False, True) if case.dtype != "float32" else (False,):
        results += cuflash.attention_backward(do, q, k, v, *out, deterministic=deterministic, **kwargs)
    return all(bool(cupy.isfinite(x).all()) for x in results)


def _form(form):
    """The context a case runs in: as dispatched, with the wgmma forward off, with inputs the
    copy engine 'cannot map' (the wgmma forward's cp.async form), or with the mma.sync backward."""
    if form == "wgmma off":
        return _config.wgmma_forward(False)
    if form == "cp.async":
        return tma_refused()
    if form == "wgmma backward off":
        return _config.wgmma_backward(False)
    return contextlib.nullcontext()


def shard(text: str) -> tuple:
    """'K/N' -> (K, N): the K-th of N interleaved slices of the run list."""
    k, _, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is K/N, e.g. 0/4; got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"a shard K/N needs 0 <= K < N; got {text!r}")
    return k, n


def coverage_line(known: set, launched: set) -> str:
    missing = sorted(known - launched)
    return (f"covered {len(known & launched)} of {len(known)} dispatcher variants"
            + (f", {len(launched - known)} more not in _config.all_variants()" if launched - known else "")
            + (f"; missing: {', '.join(missing)}" if missing else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", choices=("all", "one"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", type=shard, default=(0, 1), metavar="K/N",
                        help="run every N-th case from the K-th (shards run side by side)")
    parser.add_argument("--launched", metavar="FILE", help="write the variant keys launched to FILE")
    parser.add_argument("--coverage", nargs="+", metavar="FILE",
                        help="only merge --launched files of several shards into one coverage line")
    args = parser.parse_args(argv)

    import cupy

    arch = cupy.cuda.Device().compute_capability
    known = {v.key for v in _config.variants_for(arch)}
    if args.coverage:
        launched = set()
        for path in args.coverage:
            launched |= set(Path(path).read_text().split())
        print(coverage_line(known, launched))
        return 0

    cupy.cuda.set_allocator(None)  # every array its own cudaMalloc: nothing hides an overrun
    cupy.cuda.set_pinned_memory_allocator(None)
    launched = set()
    get_kernel = _loader.get_kernel

    def recording_get_kernel(variant, device=None):
        launched.add(variant.key)
        return get_kernel(variant, device)

    _loader.get_kernel = recording_get_kernel
    rng = np.random.default_rng(args.seed)
    failures = 0
    case_list = cases(args.subset)
    runs = [(case, "") for case in case_list] + [(case, "") for case in decode_cases(args.subset)]
    if _config.has_wgmma(arch):
        # The forms the default wgmma kernels replace stay reachable: the mma.sync forward
        # (CUFLASH_WGMMA=0) and backward (CUFLASH_WGMMA_BWD=0), the cp.async wgmma forward
        # (inputs TMA cannot map). Run the cases that pick the wgmma kernels once more in each,
        # and (the cases are short, so persistent where the table says so) with LONG_QUERIES
        # query rows, which run one item a CTA, through TMA and through cp.async.
        hopper = [case for case in case_list
                  if case.dtype != "float32" and case.d == case.dv and case.d in _tiles.SM90_FORWARD_TILES]
        runs += [(case, form) for form in ("wgmma off", "cp.async", "wgmma backward off") for case in hopper]
        persistent = [case for case in hopper
                      if _config.forward_config(case.dtype, case.d, case.dv, case.causal, wgmma=True, nq=case.nq).persistent]
        runs += [(case._replace(nq=LONG_QUERIES), form) for form in ("", "cp.async") for case in persistent]
    k, n = args.shard
    for case, form in runs[k::n]:
        start = time.perf_counter()
        with _form(form):
            finite = (run_decode_case if isinstance(case, DecodeCase) else run_case)(case, rng, args.subset)
        failures += not finite
        label = f" ({form})" if form else ""
        print(f"{case}{label} {'ok' if finite else 'NON-FINITE OUTPUT'} {time.perf_counter() - start:.1f} s", flush=True)
    if args.launched:
        Path(args.launched).write_text("".join(key + "\n" for key in sorted(launched)))
    print(("" if n == 1 else f"shard {k}/{n}: ") + coverage_line(known, launched))
    return 3 if failures else 0  # 1 is compute-sanitizer's --error-exitcode


if __name__ == "__main__":
    sys.exit(main())
