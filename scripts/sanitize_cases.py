"""The case matrix scripts/sanitize.sh runs under compute-sanitizer: every kernel variant the
dispatcher can pick, at small sizes.

    python scripts/sanitize_cases.py [--subset all|one] [--seed N] [--shard K/N] [--launched FILE]
                                     [--cubins DIR]
    python scripts/sanitize_cases.py --coverage FILE [FILE ...]

Per case: the forward, then the backward (preprocess, key passes, dQ) with atomic and with
deterministic dQ. Inputs are strided views (a (B, N, H, d) buffer seen as (B, H, N, d)) with
broadcast or grouped heads and odd lengths, so tile edges, padded head dims and the batch
offset arithmetic are all exercised.

``--subset all`` (memcheck, initcheck): each dtype x head dims 32..256 (every bucket, plus 40
and d != dv), causal with Nq < Nk and Nq > Nk (rows without keys), and block-sparse and
windowed cases when cuflash.attention takes them. ``--subset one`` (racecheck, synccheck, which
are slow): one case per variant, and of the runs only those that launch a variant no earlier
run does (:func:`runs`). Both subsets hold, per 16-bit dtype, a case of 300 slices
(MANY_ITEMS) whose persistent key pass walks several items a CTA, and packed batches (varlen)
over every head-dim bucket whose boundaries hold empty sequences, a sequence without keys and
entries outside [0, total], which the kernels must clamp (packed_lengths). On wgmma GPUs the
grouped key pass (a CTA walks every query head of its k/v head), which the dispatcher takes
only for large grids, is forced on cases with grouped heads (GROUPED_HEADS), and block-sparse
forwards at LONG_QUERIES rows under a mask of every block run their one-item-a-CTA form. No
case reaches the wgmma key pass at head dim 64 that is dense, not causal, through TMA and one
item a CTA (bwd_sm90_*_d64_s2_atomic_dq_tma): the dispatcher takes it only past 2^31 (key tile,
slice) items, where the persistent form's 32-bit count ends (_config.backward_plan); the
smallest such launch has 2^31 CTAs, out of a sanitizer run's reach.

Decoding (cuflash._api.decode_attention): every variant, dense and paged (vLLM's layout as a view), split and
not, with lengths past the capacity and page-table entries outside [0, num_pages), which the
kernels must clamp and mask without reading out of bounds.

CuPy's memory pool is switched off, so every array is its own cudaMalloc: a read past the end
of an input, or of an output never written (initcheck), is caught instead of landing in a
neighbour's block. The last line says how many of ``_config.variants_for()`` (this GPU's
variants) ran, and how many of their families (:func:`family`: a kernel with its form flags,
per dtype); tests/test_sanitize_cases.py checks on the CPU that the case list reaches every
family the enumeration holds, so a new family without a case fails there. ``--cubins DIR``
keeps each launched variant's cubin as it ran, DIR/<key>.cubin, for scripts/racecheck_hazards.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_util import head_group_forced, random_array, tma_refused  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _config, _constants, _loader, _tiles, masks  # noqa: E402

ODD_LENGTHS = (77, 131)
# Enough (key tile, slice) items that the persistent wgmma key pass (head dim 64, not causal)
# walks several a CTA: 3 x 100 slices of 3 key tiles (300 keys) are 900, ~7 a CTA on 132 SMs,
# so each of its two K, V buffers is refilled and its barriers' phases turn over.
MANY_ITEMS = (3, 100, 100)
LONG_QUERIES = 1100  # past the 1024 rows up to which the wgmma forward runs a persistent grid
# (batch, query heads, k/v heads): the fewest heads that are grouped (cuflash._broadcast.kv_group
# needs k/v heads > 1; one k/v head is broadcast, and its gradients are summed by CuPy).
GROUPED_HEADS = (1, 4, 2)


class Case(NamedTuple):
    dtype: str
    d: int
    dv: int
    nq: int
    nk: int
    causal: bool
    sparse: Optional[str] = None  # None, "block", "window" or "block+window"
    slices: Optional[tuple] = None  # (batch, query heads, k/v heads); None: run_case's
    varlen: bool = False  # a packed batch whose longest sequences are nq and nk (packed_lengths)


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
            out += [Case(dtype, d, d, short, long, False, varlen=True),
                    Case(dtype, d, d, long, short, True, varlen=True)]
            if subset == "all":
                out.append(Case(dtype, d, d, short, long, True))
        if dtype != "float32":
            out.append(Case(dtype, 64, 64, short, 300, False, slices=MANY_ITEMS))
        elif subset == "one":  # float32's reduce kernel runs only for grouped heads (slices_of's are broadcast)
            out.append(Case(dtype, 32, 32, short, long, False, slices=GROUPED_HEADS))
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


EVERY_BLOCK = "every block"  # a Case.sparse: a block mask with every block set


def mask_kwargs(case, rng):
    """block_mask= / window= arguments for a sparse case (a random mask, or EVERY_BLOCK's, and
    a small window)."""
    kwargs = {}
    if "block" in case.sparse:
        bq, bk = (32, 48) if case.causal else (64, 64)
        tq, tk = -(-case.nq // bq), -(-case.nk // bk)
        blocks = np.ones((tq, tk), bool) if case.sparse == EVERY_BLOCK else rng.random((tq, tk)) < 0.5
        kwargs["block_mask"] = masks.BlockMask.from_dense(blocks, (bq, bk))
    if "window" in case.sparse:
        kwargs["window"] = (23, -1 if case.causal else 9)
    return kwargs


def strided(rng, batch, heads, n, d, dtype):
    """A (batch, heads, n, d) view of a (batch, n, heads, d) device buffer."""
    import cupy

    return cupy.asarray(random_array(rng, (batch, n, heads, d), dtype)).swapaxes(1, 2)


def slices_of(case, subset) -> tuple:
    """(batch, query heads, k/v heads) of a case: its own, or for ``all`` 2 batches of 4 query
    heads on 2 kv heads (grouped), for ``one`` 2 heads on one kv head."""
    return case.slices or ((2, 4, 2) if subset == "all" else (1, 2, 1))


def run_case(case, rng, subset):
    import cupy

    if case.varlen:
        return run_varlen_case(case, rng, subset)
    batch, hq, hkv = slices_of(case, subset)
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


def packed_lengths(nq, nk) -> tuple:
    """A packed batch's sequences around a case's longest (nq, nk), as (query rows, keys): one
    without queries, the longest, one without keys, and a shorter one. packed_boundaries adds
    a boundary before row 0 and one past the last row: two more sequences, empty once clamped."""
    return (0, 1), (nq, nk), (1, 0), (nq // 2, nk // 3)


PACKED_BEFORE, PACKED_PAST = -5, 40


def packed_boundaries(lengths) -> np.ndarray:
    """int32 boundaries of sequences of ``lengths`` from row 0, with a first one PACKED_BEFORE
    and a last one PACKED_PAST the rows."""
    ends = np.cumsum([0, *lengths])
    return np.array([PACKED_BEFORE, *ends, ends[-1] + PACKED_PAST], np.int32)


def run_varlen_case(case, rng, subset):
    """A packed batch (packed_lengths) in flash-attn's (total, heads, d) layout, seen as
    (heads, total, d), forward and backward. The gradients go to zeroed out= buffers: the key
    rows of a sequence without queries need not be written."""
    import cupy

    _, hq, hkv = slices_of(case, subset)
    lengths_q, lengths_k = zip(*packed_lengths(case.nq, case.nk))
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, do = (strided(rng, 1, hq, total_q, dim, case.dtype)[0] for dim in (case.d, case.dv))
    k, v = (strided(rng, 1, hkv, total_k, dim, case.dtype)[0] for dim in (case.d, case.dv))
    packed = dict(causal=case.causal, cu_seqlens_q=cupy.asarray(packed_boundaries(lengths_q)),
                  cu_seqlens_k=cupy.asarray(packed_boundaries(lengths_k)), max_seqlen_q=case.nq,
                  max_seqlen_k=case.nk)
    out = cuflash.attention(q, k, v, **packed)
    results = [out.o]
    for deterministic in (False, True) if case.dtype != "float32" else (False,):
        grads = tuple(cupy.zeros(x.shape, x.dtype) for x in (q, k, v))
        results += cuflash.attention_backward(do, q, k, v, *out, deterministic=deterministic, out=grads, **packed)
    return all(bool(cupy.isfinite(x).all()) for x in results)


# The contexts a case runs in besides the dispatcher's own choice: the wgmma forward off, inputs
# the copy engine 'cannot map' (the wgmma kernels' cp.async forms), the mma.sync backward, and
# the grouped wgmma key pass (a CTA walks every query head of its k/v head; dispatched only for
# grids of GROUPED_BACKWARD_WAVES waves). A form joins them with '+'.
FORM_CONTEXTS = {
    "wgmma off": lambda: _config.wgmma_forward(False),
    "cp.async": tma_refused,
    "wgmma backward off": lambda: _config.wgmma_backward(False),
    "grouped": lambda: head_group_forced("all"),
}


def _form(form):
    stack = contextlib.ExitStack()
    for part in filter(None, form.split("+")):
        stack.enter_context(FORM_CONTEXTS[part]())
    return stack


SM_COUNT = 132  # the SMs the model below assumes (an H100's, an H200's), as the decode cases do


def launched_by(case, form, subset, arch) -> set:
    """The variants one run launches on a GPU of ``arch`` with SM_COUNT SMs, as cuflash's
    choice functions (cuflash._config) pick them under the run's form: the dispatch, modelled
    without a GPU (what the coverage line of a GPU run measures)."""
    from cuflash import _variants

    from cuflash import _backward, _broadcast

    parts = set(filter(None, form.split("+")))
    tma = "cp.async" not in parts
    if isinstance(case, DecodeCase):
        hq, hk = case.heads
        rows, sequences = hq // hk * case.nq, DECODE_BATCH * hk
        variant = _config.decode_config(case.dtype, case.d, case.d, case.page_size is not None, rows, sequences,
                                        DECODE_CAPACITY, SM_COUNT)
        key_tiles = -(-DECODE_CAPACITY // variant.block_cols)
        ctas = sequences * -(-rows // variant.block_rows)
        splits = case.num_splits or _config.decode_splits(ctas, key_tiles, SM_COUNT)[0]
        combine = _config.decode_combine_config(case.dtype, sequences * rows, SM_COUNT)
        return {variant, combine} if splits > 1 else {variant}
    batch, hq, hkv = slices_of(case, subset)
    block_mask = bool(case.sparse and "block" in case.sparse)
    wgmma = _config.has_wgmma(arch)
    forward = dict(sparse=block_mask, wgmma=wgmma and "wgmma off" not in parts, nq=case.nq, tma=tma,
                   varlen=case.varlen, slices=batch * hq)
    variant = _config.forward_config(case.dtype, case.d, case.dv, case.causal, **forward)
    if block_mask and isinstance(variant, _variants.HopperForward):
        # The mean key tiles a query tile visits, at most all of them: the choice is exact where
        # that bound is within _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES (few keys) and where
        # even the causal mean of an EVERY_BLOCK mask passes it (2 LONG_QUERIES keys).
        variant = _config.forward_config(case.dtype, case.d, case.dv, case.causal,
                                         row_tiles=lambda rows, cols: -(-case.nk // cols), **forward)
    launched = {variant}
    kv_group = _broadcast.kv_group(hq, hkv)
    if case.varlen:  # (heads, rows, d) arrays: packed sequences in the rows
        lead, kv_lead, (nq, nk) = (hq,), (hkv,), map(sum, zip(*packed_lengths(case.nq, case.nk)))
    else:
        lead, kv_lead, nq, nk = (batch, hq), (batch, hkv), case.nq, case.nk
    grad_shapes = (lead + (nq, case.d), kv_lead + (nk, case.d), kv_lead + (nk, case.dv))
    for deterministic in (False, True) if case.dtype != "float32" else (False,):
        plan = _config.backward_plan(case.dtype, case.d, case.dv, case.causal, deterministic,
                                     hopper=_config.is_hopper(arch), sparse=block_mask, wgmma=wgmma,
                                     wgmma_backward_on="wgmma backward off" not in parts, varlen=case.varlen,
                                     grouped="grouped" in parts and kv_group > 1, tma=tma, nk=case.nk,
                                     slices=batch * hq)
        launched |= {plan.preprocess, *plan.key_passes, plan.dq} - {None}
        # The 'grouped' form makes a key-pass CTA walk the whole k/v group (head_group_forced)
        head_group = kv_group if any(getattr(k, "grouped", False) for k in plan.key_passes) else 1
        grads = _backward.gradient_layout(grad_shapes, lead, kv_group, case.dtype, 1, 1, head_group)[0]
        if any(g.kind == "reduce" for g in grads):  # a float32 accumulator to convert or grouped heads to sum
            launched.add(_variants.GradientReduce(case.dtype))
    return launched


def runs(subset, arch) -> list:
    """[(case, form)] that main() runs on a GPU of compute capability ``arch``."""
    case_list = cases(subset)
    out = [(case, "") for case in case_list] + [(case, "") for case in decode_cases(subset)]
    if _config.has_wgmma(arch):
        # The forms the default wgmma kernels replace stay reachable: the mma.sync forward
        # (CUFLASH_WGMMA=0) and backward (CUFLASH_WGMMA_BWD=0), the cp.async wgmma forward
        # (inputs TMA cannot map). Run the cases that pick the wgmma kernels once more in each,
        # and (the cases are short, so persistent where the table says so) with LONG_QUERIES
        # query rows, which run one item a CTA, through TMA and through cp.async.
        hopper = [case for case in case_list
                  if case.dtype != "float32" and case.d == case.dv and case.d in _tiles.SM90_FORWARD_TILES]
        out += [(case, form) for form in ("wgmma off", "cp.async", "wgmma backward off") for case in hopper]
        persistent = [case for case in hopper
                      if _config.forward_config(case.dtype, case.d, case.dv, case.causal, wgmma=True, nq=case.nq).persistent]
        out += [(case._replace(nq=LONG_QUERIES), form) for form in ("", "cp.async") for case in persistent]
        grouped = [case._replace(slices=GROUPED_HEADS) for case in hopper if not case.sparse]
        grouped = [case for case in grouped
                   if any(getattr(v, "grouped", False) for v in launched_by(case, "grouped", subset, arch))]
        out += [(case, form) for form in ("grouped", "grouped+cp.async") for case in grouped]
        # A block-sparse forward whose query tiles visit few key tiles runs persistent at any
        # length (_tiles.SM90_SPARSE_PERSISTENT_ROW_TILES); past LONG_QUERIES rows, with twice
        # as many keys and every block set, they visit more, and one item a CTA runs.
        dense_masks = [case._replace(nq=LONG_QUERIES, nk=2 * LONG_QUERIES, sparse=EVERY_BLOCK) for case in hopper
                       if case.sparse == "block" and case.d in _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES]
        out += [(case, form) for form in ("", "cp.async") for case in dense_masks]
    if subset == "one":  # a run only where it launches a variant no earlier run does (and MANY_ITEMS)
        seen, kept = set(), []
        for case, form in out:
            new = launched_by(case, form, subset, arch) - seen
            if new or getattr(case, "slices", None) == MANY_ITEMS:
                kept.append((case, form))
                seen |= new
        out = kept
    return out


# Flags that vary inside a family: the mask's causality, which gradients a key pass writes,
# and the wgmma forward's schedule (fixed per head dim by the tile table).
FLAGS_INSIDE_A_FAMILY = ("causal", "do_dk", "do_dv", "atomic_dq", "overlap", "pingpong")


def family(variant) -> str:
    """A variant's family: its kind (key prefix), dtype and the form flags it has set, e.g.
    'bwd_sm90 bfloat16 grouped tma varlen'. A new flag or a new kind of kernel is a new family."""
    flags = sorted(field.name for field in dataclasses.fields(variant)
                   if field.name not in FLAGS_INSIDE_A_FAMILY and getattr(variant, field.name) is True)
    return " ".join([variant.key_prefix, variant.dtype, *flags])


def families_line(variants, launched: set) -> str:
    """How many of the families of ``variants`` had a variant among the ``launched`` keys."""
    families = {family(v) for v in variants}
    reached = {family(v) for v in variants if v.key in launched}
    missing = sorted(families - reached)
    return (f"families covered {len(reached)} of {len(families)}"
            + (f"; families missing: {', '.join(missing)}" if missing else ""))


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


@contextlib.contextmanager
def recording_cubins(cubins: dict, building: list):
    """Inside the block, what CuPy's kernel cache loads or saves while ``building`` names a
    variant (its key last), the module get_kernel loads, goes to ``cubins`` as {key: cubin}: the
    machine code that runs, whose offsets the sanitizer reports. A cache payload is the mangled
    names, then the cubin (cupy.cuda.compiler._decode_cache_payload)."""
    from cupy.cuda import compiler

    backend = compiler._kernel_cache_backend

    def keep(payload):
        decoded = compiler._decode_cache_payload(payload, 1) if payload is not None else None
        if decoded is not None and building:
            cubins.setdefault(building[-1], decoded[1])

    class Recording:  # the backend's load and save, which is all CuPy calls
        def load(self, name):
            payload = backend.load(name)
            keep(payload)
            return payload

        def save(self, name, cubin, source):
            keep(cubin)
            backend.save(name, cubin, source)

    compiler._set_kernel_cache_backend(Recording())
    try:
        yield
    finally:
        compiler._set_kernel_cache_backend(backend)


def write_cubins(cubins: dict, directory: Path):
    """DIR/<key>.cubin for each; shards write side by side, so each file appears whole."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, cubin in cubins.items():
        part = directory / f"{key}.cubin.{os.getpid()}"
        part.write_bytes(cubin)
        os.replace(part, directory / f"{key}.cubin")


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
    parser.add_argument("--cubins", metavar="DIR", type=Path, help="write each launched variant's cubin to DIR")
    parser.add_argument("--coverage", nargs="+", metavar="FILE",
                        help="only merge --launched files of several shards into one coverage line")
    args = parser.parse_args(argv)

    import cupy

    arch = cupy.cuda.Device().compute_capability
    variants = _config.variants_for(arch)
    known = {v.key for v in variants}
    if args.coverage:
        launched = set()
        for path in args.coverage:
            launched |= set(Path(path).read_text().split())
        print(f"{coverage_line(known, launched)}; {families_line(variants, launched)}")
        return 0

    cupy.cuda.set_allocator(None)  # every array its own cudaMalloc: nothing hides an overrun
    cupy.cuda.set_pinned_memory_allocator(None)
    launched, building, cubins = set(), [], {}
    get_kernel = _loader.get_kernel

    def recording_get_kernel(variant, device=None):
        launched.add(variant.key)
        building.append(variant.key)
        try:
            return get_kernel(variant, device)
        finally:
            building.pop()

    _loader.get_kernel = recording_get_kernel
    rng = np.random.default_rng(args.seed)
    failures = 0
    k, n = args.shard
    with recording_cubins(cubins, building) if args.cubins else contextlib.nullcontext():
        for case, form in runs(args.subset, arch)[k::n]:
            start = time.perf_counter()
            with _form(form):
                finite = (run_decode_case if isinstance(case, DecodeCase) else run_case)(case, rng, args.subset)
            failures += not finite
            label = f" ({form})" if form else ""
            print(f"{case}{label} {'ok' if finite else 'NON-FINITE OUTPUT'} {time.perf_counter() - start:.1f} s",
                  flush=True)
    if args.launched:
        Path(args.launched).write_text("".join(key + "\n" for key in sorted(launched)))
    if args.cubins:
        write_cubins(cubins, args.cubins)
    print(("" if n == 1 else f"shard {k}/{n}: ")
          + f"{coverage_line(known, launched)}; {families_line(variants, launched)}")
    return 3 if failures else 0  # 1 is compute-sanitizer's --error-exitcode


if __name__ == "__main__":
    sys.exit(main())
