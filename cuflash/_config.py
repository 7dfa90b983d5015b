"""The choices: which kernel variants run for which arguments, and the switches that change it.

Every function here answers one question from the call's dtype, head dims, flags and (for
decoding) sizes: :func:`forward_config`, :func:`backward_plan`, :func:`decode_config`,
:func:`decode_splits`. Their answers are the launch dataclasses of cuflash/_variants.py, filled
in from the tile tables of cuflash/_tiles.py; the fixed limits are in cuflash/_constants.py.
The enumerations (:func:`all_variants`, :func:`variants_for`) list every variant these
functions can return, which is what the offline compile check builds. The switches
(:func:`wgmma_forward`, :func:`wgmma_backward`) and the tile overrides for tuning runs bump
:data:`GENERATION` (:func:`bump_generation`), so that cached launch plans are rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import typing

from . import _constants, _tiles
from ._variants import (BackwardPlan, BackwardPreprocess, DecodeCombine, Float32BackwardDkDv, Float32BackwardDq,
                        Float32Forward, GradientReduce, HopperBackward, HopperForward, SplitKvDecode,
                        TensorCoreBackward, TensorCoreBackwardDq, TensorCoreForward)

# ---- switches and architectures -----------------------------------------------------------

# The switch wgmma_forward() flips; CUFLASH_WGMMA=0 in the environment starts with it off.
_wgmma_forward = [os.environ.get("CUFLASH_WGMMA", "1") != "0"]


# Bumped (by bump_generation) whenever a switch or a table override changes what the dispatcher
# picks: the plan cache (cuflash/_cache.py) empties then, as plans hold the old choices.
GENERATION = [0]
_generation_listeners: list = []


def on_generation_change(listener):
    """Call ``listener()`` after every change of the choices (bump_generation)."""
    _generation_listeners.append(listener)


def bump_generation():
    """Say that the choices changed: every plan built before is out of date."""
    GENERATION[0] += 1
    for listener in _generation_listeners:
        listener()


@contextlib.contextmanager
def _switched(switch: list, enabled: bool):
    """Temporarily set a module switch (a one-element list)."""
    saved = switch[0]
    switch[0] = bool(enabled)
    bump_generation()
    try:
        yield
    finally:
        switch[0] = saved
        bump_generation()


def wgmma_forward(enabled: bool):
    """Turn the wgmma forward on or off (on by default where the GPU has it), e.g. to compare
    it with the mma.sync kernel on the same H100/H200 in one process."""
    return _switched(_wgmma_forward, enabled)


# The switch wgmma_backward() flips; CUFLASH_WGMMA_BWD=0 in the environment starts with it off.
_wgmma_backward = [os.environ.get("CUFLASH_WGMMA_BWD", "1") != "0"]


def wgmma_backward(enabled: bool):
    """Turn the wgmma backward key pass on or off (on by default where the GPU has wgmma)."""
    return _switched(_wgmma_backward, enabled)


def _capability(arch: str) -> int:
    """'sm_90a' / '90' -> 90."""
    return int("".join(c for c in arch if c.isdigit()))


def has_wgmma(arch: str) -> bool:
    """'sm_90a' / '90' -> True: wgmma exists on compute capability 9.0 only (sm_90a code)."""
    return _capability(arch) == 90


def is_hopper(arch: str) -> bool:
    """'sm_90a' / '90' (compute capability) -> True; 'sm_80' / '86' -> False."""
    return _capability(arch) >= 90


# ---- forward ------------------------------------------------------------------------------


def head_dim_bucket(dim: int) -> int:
    for bucket in _tiles.HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds {_constants.MAX_HEAD_DIM}")


def persistent_query_tiles(d: int, causal: bool):
    """The wgmma forward's persistent rule at head dim d: True, False, or the most query tiles
    a head may have for the persistent form (_tiles.SM90_FORWARD_TILES's last field)."""
    bound = _tiles.SM90_FORWARD_TILES[d][-1]
    return bound[bool(causal)] if isinstance(bound, tuple) else bound


def forward_config(dtype: str, d: int, dv: int, causal: bool, *, tiles=None, sparse: bool = False,
                   wgmma: bool = False, nq: typing.Optional[int] = None, tma: bool = True,
                   slices: int = 1, varlen: bool = False,
                   row_tiles: typing.Optional[typing.Callable[[int, int], float]] = None):
    """The kernel variant the dispatcher runs for these arguments.

    ``tiles`` = (block_rows, block_cols, warps, min_blocks[, qk_unroll]) overrides the table
    (used by tuning runs). ``sparse``: the launch walks block-sparse tile lists. ``wgmma``: the
    GPU has wgmma (:func:`has_wgmma`); head dims 64 and 128 (d = dv) then run on it. ``nq``:
    the query length, which picks the wgmma forward's persistent form or not. ``tma``: whether
    the copy engine can map q, k and v (else the wgmma forward loads with cp.async).
    ``slices``: the launch's (batch..., head) slices; a persistent grid counts its items
    (query tiles x slices) in 32 bits, so past 2^31 items it runs one item a CTA.
    ``varlen``: a packed variable-length batch: the same tiles in their VARLEN form (never
    block-sparse), nq its longest sequence; on wgmma persistent where a dense batch of that
    length would be. ``row_tiles``: with ``sparse``, row_tiles(block_rows, block_cols) is the
    mean number of key tiles a query tile of that shape visits (the block mask's tile lists
    count them), which makes the wgmma forward persistent at any length where it is at most
    _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES; it is asked only where it decides.
    """
    if varlen:
        variant = forward_config(dtype, d, dv, causal, tiles=tiles, wgmma=wgmma, nq=nq, tma=tma, slices=slices)
        return dataclasses.replace(variant, varlen=True)
    if (wgmma and tiles is None and _wgmma_forward[0] and dtype in _constants.TENSOR_CORE_DTYPES and d == dv
            and d in _tiles.SM90_FORWARD_TILES):
        *schedule, persistent = _tiles.SM90_FORWARD_TILES[d]
        q_tiles = None if nq is None else -(-nq // HopperForward.block_rows)
        persistent = persistent_query_tiles(d, causal)
        if not isinstance(persistent, bool):
            persistent = q_tiles is not None and q_tiles <= persistent
        few_tiles = _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES.get(d)
        if (sparse and row_tiles is not None and few_tiles is not None and not persistent
                and row_tiles(HopperForward.block_rows, schedule[0]) <= few_tiles):
            persistent = True
        if q_tiles is not None and q_tiles * slices >= 2**31:
            persistent = False
        return HopperForward(dtype, d, *schedule, bool(tma), persistent, bool(causal), sparse=bool(sparse))
    if dtype == "float32":
        value_tiles = -(-dv // 32)
        # O holds rows_per_warp x value_tiles fp32 registers a lane; keep it near 16-32.
        rows_per_warp = 8 if value_tiles <= 2 else 4 if value_tiles <= 4 else 2
        return Float32Forward(value_tiles, bool(causal), rows_per_warp=rows_per_warp, sparse=bool(sparse))
    hd = head_dim_bucket(max(d, dv))  # one bucket for both keeps the variant count small
    br, bc, warps, mb, *unroll = tiles or _tiles.TC_FORWARD_TILES[hd]
    return TensorCoreForward(dtype, hd, hd, br, bc, warps, mb, bool(causal), *unroll, sparse=bool(sparse))


class ForwardChoice(typing.NamedTuple):
    """The forward kernel a launch runs, and the one it runs instead where the copy engine
    cannot map its inputs (the cp.async form; None where the kernel loads without tensor maps)."""

    variant: typing.Any
    without_tensor_maps: typing.Any


def forward_choice(dtype: str, d: int, dv: int, causal: bool, *, wgmma: bool, nq: int, slices: int,
                   varlen: bool = False, row_tiles=None) -> ForwardChoice:
    """The forward of a launch (forward_config's arguments; ``row_tiles`` given exactly for a
    block-sparse launch) with its fallback named."""
    variant = forward_config(dtype, d, dv, causal, sparse=row_tiles is not None, wgmma=wgmma, nq=nq,
                             slices=slices, varlen=varlen, row_tiles=row_tiles)
    fallback = dataclasses.replace(variant, tma=False) if getattr(variant, "tma", False) else None
    return ForwardChoice(variant, fallback)


def _hopper_forms(dtype, hd, causal, sparse=False, varlen=False):
    """The wgmma forward's forms the dispatcher can pick for these arguments: for short and long
    queries (persistent or not, where the table switches on length), and the forms it falls
    back to: cp.async for inputs the copy engine cannot map, one item a CTA past 2^31 items."""
    forms = set()
    for nq in (1, 2**30):
        variant = forward_config(dtype, hd, hd, causal, sparse=sparse, wgmma=True, nq=nq, varlen=varlen)
        forms |= {variant, dataclasses.replace(variant, tma=False), dataclasses.replace(variant, persistent=False),
                  dataclasses.replace(variant, tma=False, persistent=False)}
    return sorted(forms, key=lambda v: v.key)


def all_forward_variants(wgmma: bool = False):
    """Every variant the dispatcher can pick (what the offline compile check builds)."""
    variants = []
    if wgmma:
        for sparse in (False, True):
            for causal in (False, True):
                for dtype in ("float16", "bfloat16"):
                    for hd in sorted(_tiles.SM90_FORWARD_TILES):
                        variants += _hopper_forms(dtype, hd, causal, sparse=sparse)
                        if not sparse:
                            variants += _hopper_forms(dtype, hd, causal, varlen=True)
    for sparse in (False, True):
        for causal in (False, True):
            for dtype in ("float16", "bfloat16"):
                for hd in _tiles.HEAD_DIM_BUCKETS:
                    variants.append(forward_config(dtype, hd, hd, causal, sparse=sparse))
                    if not sparse:
                        variants.append(forward_config(dtype, hd, hd, causal, varlen=True))
            for dvt in range(1, _constants.MAX_HEAD_DIM // 32 + 1):
                variants.append(forward_config("float32", 32 * dvt, 32 * dvt, causal, sparse=sparse))
                if not sparse:
                    variants.append(forward_config("float32", 32 * dvt, 32 * dvt, causal, varlen=True))
    return variants


@contextlib.contextmanager
def _table_override(table, entries):
    """Temporarily update a tile table (for tuning runs that compare tiles in one process)."""
    saved = dict(table)
    table.update(entries)
    bump_generation()
    try:
        yield
    finally:
        table.clear()
        table.update(saved)
        bump_generation()


def forward_tiles_override(tiles_by_bucket):
    """Temporarily replace _tiles.TC_FORWARD_TILES entries
    {head_dim_bucket: (block_rows, block_cols, warps, min_blocks[, qk_unroll])}."""
    return _table_override(_tiles.TC_FORWARD_TILES, tiles_by_bucket)


# ---- backward -----------------------------------------------------------------------------


def backward_plan(dtype: str, d: int, dv: int, causal: bool, deterministic: bool, *,
                  hopper: bool = True, sparse: bool = False, wgmma: bool = False,
                  wgmma_backward_on: typing.Optional[bool] = None, varlen: bool = False,
                  grouped: bool = False, tma: bool = True, nk: typing.Optional[int] = None,
                  slices: int = 1) -> BackwardPlan:
    """The kernels one backward launches; ``hopper``: the GPU has compute capability >= 9.0;
    ``sparse``: they walk block-sparse tile lists; ``wgmma``: the GPU has wgmma, and the
    wgmma key pass is switched on (``wgmma_backward_on``, default the module switch);
    ``varlen``: a packed variable-length batch, every kernel in its VARLEN form (never sparse);
    ``grouped``: a wgmma key pass walks several query heads of a k/v head
    (backward_head_group; never sparse); ``tma``: the copy engine can map q, k, v and dO (else
    the wgmma key pass loads with cp.async). ``nk``, ``slices``: the keys and the launch's
    (batch..., head) slices; a persistent key pass counts its items (key tiles x slices) in 32
    bits, so past 2^31 items it runs one item a CTA (k broadcast over millions of slices)."""
    if varlen:
        plan = backward_plan(dtype, d, dv, causal, deterministic, hopper=hopper, wgmma=wgmma,
                             wgmma_backward_on=wgmma_backward_on, grouped=grouped, tma=tma)

        def packed(kernel):
            if isinstance(kernel, HopperBackward):
                return dataclasses.replace(kernel, varlen=True, persistent=False)
            return None if kernel is None else dataclasses.replace(kernel, varlen=True)

        return BackwardPlan(packed(plan.preprocess), tuple(map(packed, plan.key_passes)), packed(plan.dq),
                            plan.atomic_dq)
    causal, sparse = bool(causal), bool(sparse)
    pre = BackwardPreprocess(dtype)
    on = _wgmma_backward[0] if wgmma_backward_on is None else wgmma_backward_on
    if wgmma and on and dtype in _constants.TENSOR_CORE_DTYPES and d == dv and d in (64, 128):
        dq_tiles = _tiles.TC_BACKWARD_DQ_TILES[d]
        dq = None if not deterministic else TensorCoreBackwardDq(dtype, d, d, *dq_tiles, causal, sparse)
        grouped = grouped and not sparse and not deterministic
        items = None if nk is None else -(-nk // HopperBackward.block_cols) * slices
        persistent = (d in _tiles.SM90_PERSISTENT_BACKWARD_DIMS and bool(tma) and not causal
                      and not (sparse or grouped or deterministic) and (items is None or items < 2**31))
        key_pass = HopperBackward(dtype, d, not deterministic, causal, sparse=sparse, grouped=grouped, tma=bool(tma),
                                  persistent=persistent)
        return BackwardPlan(pre, (key_pass,), dq, not deterministic)
    if dtype == "float32":
        dim_tiles = -(-max(d, dv) // 32)
        keys_per_warp = 4 if dim_tiles <= 4 else 2
        rows_per_warp = 8 if dim_tiles <= 2 else 4 if dim_tiles <= 4 else 2
        return BackwardPlan(
            pre,
            (Float32BackwardDkDv(dim_tiles, causal, keys_per_warp=keys_per_warp, sparse=sparse),),
            Float32BackwardDq(dim_tiles, causal, rows_per_warp=rows_per_warp, sparse=sparse),
            False,
        )
    hd = head_dim_bucket(max(d, dv))
    hd_keys = hd if hd in _tiles.TC_BACKWARD_TILES else head_dim_bucket(hd + 1)
    atomic = not deterministic
    tiles = _tiles.TC_BACKWARD_TILES
    if not hopper:
        tiles = {**tiles, **_tiles.TC_BACKWARD_TILES_PRE_HOPPER}
    br, bc, warps, mb, *layout = tiles[hd_keys]

    def key_pass(do_dk, do_dv, atomic_dq):
        return TensorCoreBackward(dtype, hd_keys, hd_keys, br, bc, warps, mb, causal, do_dk, do_dv, atomic_dq,
                                  *layout, sparse=sparse)

    if hd <= _tiles.SPLIT_BACKWARD_ABOVE:
        passes = (key_pass(True, True, atomic),)
    else:
        passes = (key_pass(False, True, atomic), key_pass(True, False, False))
    dq = None if atomic else TensorCoreBackwardDq(dtype, hd, hd, *_tiles.TC_BACKWARD_DQ_TILES[hd], causal, sparse)
    return BackwardPlan(pre, passes, dq, atomic)


# A grouped key pass (GQA) keeps at least this many CTAs a wave of SMs: measured on the H200
# (bench/NOTES.md, Backward on Hopper (key pass)).
GROUPED_BACKWARD_WAVES = 7


def backward_head_group(kv_group: int, num_batch: int, key_tiles: int, sm_count: int) -> int:
    """How many query heads of a k/v group one wgmma key-pass CTA walks: the largest divisor of
    ``kv_group`` that leaves GROUPED_BACKWARD_WAVES waves of CTAs (``num_batch`` query-head
    slices, ``key_tiles`` CTAs each), else 1. Its dK and dV are then summed over those heads in
    registers and written once, instead of a float32 slice a head that grad_reduce.cu sums."""
    for group in range(kv_group, 1, -1):
        if kv_group % group == 0 and num_batch // group * key_tiles >= GROUPED_BACKWARD_WAVES * sm_count:
            return group
    return 1


class BackwardChoice(typing.NamedTuple):
    """The kernels of a backward launch, how many query heads a key-pass CTA walks, and the
    kernels it runs instead where the copy engine cannot map its inputs (the key pass's
    cp.async form; None where the key pass loads without tensor maps)."""

    kernels: BackwardPlan
    head_group: int
    without_tensor_maps: typing.Optional[BackwardPlan]


def backward_choice(dtype: str, d: int, dv: int, causal: bool, deterministic: bool, *, hopper: bool, wgmma: bool,
                    sparse: bool = False, varlen: bool = False, nk: typing.Optional[int] = None, slices: int = 1,
                    kv_group: int = 1, key_tiles=None, sm_count: int = 0) -> BackwardChoice:
    """The backward of a launch with its fallback named (backward_plan's arguments). kv_group:
    the query heads of a k/v head where k and v are grouped over q's heads and broadcast nowhere
    else (1 otherwise); then a wgmma key pass that accumulates dQ atomically walks
    backward_head_group of them a CTA, with key_tiles(block_cols) CTAs along a slice's keys."""
    choose = functools.partial(backward_plan, dtype, d, dv, causal, deterministic, hopper=hopper, sparse=sparse,
                               wgmma=wgmma, varlen=varlen, nk=nk, slices=slices)
    kernels, group = choose(), 1
    key_pass = kernels.key_passes[0]
    if isinstance(key_pass, HopperBackward) and key_pass.atomic_dq and not key_pass.sparse and kv_group > 1:
        group = backward_head_group(kv_group, slices, key_tiles(key_pass.block_cols), sm_count)
        if group > 1:
            kernels = choose(grouped=True)
    fallback = choose(grouped=group > 1, tma=False) if getattr(kernels.key_passes[0], "tma", False) else None
    return BackwardChoice(kernels, group, fallback)


def all_backward_variants(hopper: bool = True, wgmma: bool = False):
    variants = {}
    if wgmma:
        for causal in (False, True):
            for dtype in _constants.TENSOR_CORE_DTYPES:
                for dim in (64, 128):
                    for deterministic in (False, True):
                        for sparse, varlen, grouped in ((False, False, False), (True, False, False),
                                                        (False, True, False), (False, False, True),
                                                        (False, True, True)):
                            for tma in (False, True):
                                plan = backward_plan(dtype, dim, dim, causal, deterministic, hopper=hopper,
                                                     sparse=sparse, wgmma=True, wgmma_backward_on=True,
                                                     varlen=varlen, grouped=grouped, tma=tma)
                                for kernel in (*plan.key_passes, plan.dq):
                                    if kernel is not None:
                                        variants[kernel.key] = kernel
                                    if getattr(kernel, "persistent", False):  # past 2^31 items: one a CTA
                                        fallback = dataclasses.replace(kernel, persistent=False)
                                        variants[fallback.key] = fallback
    for causal in (False, True):
        for dtype in _constants.SUPPORTED_DTYPES:
            f32_dims = range(32, _constants.MAX_HEAD_DIM + 1, 32)
            for dim in (_tiles.HEAD_DIM_BUCKETS if dtype != "float32" else f32_dims):
                for deterministic in (False, True):
                    for sparse, varlen in ((False, False), (True, False), (False, True)):
                        plan = backward_plan(dtype, dim, dim, causal, deterministic, hopper=hopper, sparse=sparse,
                                             wgmma_backward_on=False, varlen=varlen)
                        for kernel in (plan.preprocess, *plan.key_passes, plan.dq):
                            if kernel is not None:
                                variants[kernel.key] = kernel
    return list(variants.values())


# ---- every variant ------------------------------------------------------------------------


def all_variants(hopper: bool = True, wgmma: typing.Optional[bool] = None):
    """Every kernel variant the dispatcher can launch on a GPU of that kind, forward and backward.
    ``wgmma`` defaults to ``hopper``."""
    wgmma = hopper if wgmma is None else wgmma
    reduces = [GradientReduce(dtype) for dtype in _constants.SUPPORTED_DTYPES]
    return all_forward_variants(wgmma) + all_backward_variants(hopper, wgmma) + reduces + all_decode_variants()


def variants_for(arch: str):
    """all_variants() for one architecture ('sm_80', 'sm_90a', or a compute capability '90')."""
    return all_variants(is_hopper(arch), has_wgmma(arch))


# ---- decoding -----------------------------------------------------------------------------

# The shortest key range a call with few queries a head (1 to MAX_DECODE_QUERIES) is routed to
# the split-KV kernels at: measured with CUDA graphs (GPU time alone), one query a head at
# batch 1-32, they beat the forward from 64 keys on (4.2 against 7.5 us at 64 keys;
# bench/NOTES.md, Decoding). Below it the keys fit one tile of the forward: nothing to split.
DECODE_MIN_KEYS = 64

# Splits give every SM at least one CTA (this fraction of the SMs, so 16 splits of 8 CTAs count
# on 132 SMs) and no more: measured on the H200 (bench/NOTES.md, Decoding), once each SM holds
# a CTA, longer splits stream faster than more CTAs (batch 1, 8 k/v heads, 131072 keys: 16
# splits of 128 key tiles 3.86 TB/s, 64 of 32 tiles 3.63, 256 of 8 tiles 3.04) ...
DECODE_SM_FILL = 0.9
# ... while each split keeps at least this many key tiles, so that its pipeline fills and the
# workspace and combine stay small next to the cache it streams; where that leaves SMs idle
# (short caches), DECODE_MIN_TILES_PER_SPLIT_SHORT.
DECODE_MIN_TILES_PER_SPLIT = 4
DECODE_MIN_TILES_PER_SPLIT_SHORT = 2
# A call whose splits (at one CTA an SM) come out shorter than this many key tiles aims at
# two CTAs an SM instead: a second CTA hides a split's start and end (Q, the first tiles'
# latency, the partial result's store) behind the other's stream. Swept on the H200
# (bench/NOTES.md, Decoding; CUDA-graph GPU time, num_splits 4-256): splits of 9 tiles
# gain (GQA hd128 1 x 8192, 15 -> 32 splits, 14.2 -> 12.2 us, SDPA 10.9; MQA 8 x 8192 17.6 ->
# 15.3, SDPA 15.9); from about 16 it is a wash (GQA 1 x 16384, 18 tiles: 24.0 -> 23.5; MQA
# 1 x 131072, 17 tiles: 28.2 -> 29.1; 32+ tiles: GQA 4 x 8192 38.7 / 38.8). Splitting a call
# that fits one split is left alone (it would add the merge). The shorter floor: MQA hd128 1 x
# 8192 32 splits of 4 tiles 12.2 us, 64 of 2 10.8, 128 of 1 10.6; GQA 1 x 2048 8 of 4 9.8, 16
# of 2 8.3, 32 of 1 8.8; paged caches gain from it too (MQA 1 x 8192 page 64 15.4 -> 12.6).
DECODE_SHORT_SPLIT_TILES = 16


def decode_head_dim_bucket(dim: int) -> int:
    for bucket in _tiles.DECODE_HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds {_tiles.DECODE_HEAD_DIM_BUCKETS[-1]}")


# 16-row tiles a CTA, by packed rows (group x Nq): the fewest that hold them, up to one a warp.
# Rows past a CTA's go to further row-tile CTAs, which read the same keys again (from L2 when
# they run together), so more rows a CTA saves that traffic where rows are many (MQA, or
# GQA with several queries), while few rows keep every warp on its own keys.
def decode_row_warps(rows: int) -> int:
    for row_warps in _tiles.DECODE_ROW_WARPS:
        if rows <= _constants.DECODE_ROW_TILE * row_warps:
            return row_warps
    return _tiles.DECODE_ROW_WARPS[-1]


# A cache of at most DECODE_SHORT_CACHE_KEYS keys a sequence whose grid holds at least
# DECODE_SHORT_CTAS_A_SM CTAs an SM (of DECODE_SM_FILL of them) without splitting takes
# _tiles.DECODE_TILES_SHORT where it has a form: measured at 1024-2048 CTAs and 512-2048 keys.
DECODE_SHORT_CACHE_KEYS = 2048
DECODE_SHORT_CTAS_A_SM = 4


def decode_config(dtype: str, d: int, dv: int, paged: bool, rows: int = 1, sequences: int = 0, keys: int = 0,
                  sm_count: int = 0) -> SplitKvDecode:
    """The decoding variant for 16-bit ``dtype``, head dims d (q, k) and dv (v), ``rows``
    packed query rows (query heads a k/v head x queries a head); ``sequences`` (batch x k/v
    heads), ``keys`` (the cache's capacity) and ``sm_count`` pick the short-cache form."""
    hd = decode_head_dim_bucket(max(d, dv))
    row_warps = decode_row_warps(rows)
    tiles = _tiles.DECODE_TILES[(hd, row_warps)]
    ctas = sequences * -(-rows // (_constants.DECODE_ROW_TILE * row_warps))
    if (hd, row_warps) in _tiles.DECODE_TILES_SHORT and 0 < keys <= DECODE_SHORT_CACHE_KEYS \
            and ctas >= DECODE_SHORT_CTAS_A_SM * DECODE_SM_FILL * sm_count > 0:
        tiles = _tiles.DECODE_TILES_SHORT[(hd, row_warps)]
    return SplitKvDecode(dtype, hd, *tiles, bool(paged), row_warps)


def _fill_splits(ctas_per_split: int, key_tiles: int, target: float, min_tiles: int) -> typing.Tuple[int, int]:
    """The fewest splits (and key tiles a split) that put ``target`` CTAs on the GPU, each
    keeping at least ``min_tiles`` tiles (and at most MAX_DECODE_SPLITS splits)."""
    most = max(1, min(_constants.MAX_DECODE_SPLITS, key_tiles // min_tiles))
    per_split = -(-key_tiles // min(most, max(1, math.ceil(target / ctas_per_split))))
    # Whole tiles a split can leave fewer splits than asked: shorten them until the target is
    # met or the count reaches ``most``.
    while (per_split > min_tiles and ctas_per_split * -(-key_tiles // per_split) < target
           and -(-key_tiles // (per_split - 1)) <= most):
        per_split -= 1
    return -(-key_tiles // per_split), per_split  # none left without a tile


# Paged caches take the same rules: with their pages read a few tiles ahead, the dense rules'
# split counts are at or within 1-10% faster than two CTAs an SM at every shape swept but one
# (bench/NOTES.md, Decoding; MQA 8 x 32768 hd64 page 64 28.2 against 27.4 us).


def decode_splits(ctas_per_split: int, key_tiles: int, sm_count: int) -> typing.Tuple[int, int]:
    """(splits, key tiles a split) for ``key_tiles`` tiles of keys a sequence (dense or paged),
    where one split is ``ctas_per_split`` CTAs (batch x k/v heads x row tiles): the fewest
    splits that put a CTA on DECODE_SM_FILL of the ``sm_count`` SMs, each keeping at least
    DECODE_MIN_TILES_PER_SPLIT tiles; two CTAs an SM for splits shorter than
    DECODE_SHORT_SPLIT_TILES; DECODE_MIN_TILES_PER_SPLIT_SHORT tiles where the SMs are not
    filled otherwise."""
    if key_tiles <= 0:
        return 1, 1
    filled = target = DECODE_SM_FILL * sm_count
    splits, per_split = _fill_splits(ctas_per_split, key_tiles, target, DECODE_MIN_TILES_PER_SPLIT)
    if splits > 1 and per_split < DECODE_SHORT_SPLIT_TILES:
        target = 2 * filled
        splits, per_split = _fill_splits(ctas_per_split, key_tiles, target, DECODE_MIN_TILES_PER_SPLIT)
    if ctas_per_split * splits < filled:
        splits, per_split = _fill_splits(ctas_per_split, key_tiles, target, DECODE_MIN_TILES_PER_SPLIT_SHORT)
    return splits, per_split


# The merge's warps a CTA (one CTA a row): with fewer rows than SMs (batch 1, or MQA at small
# batches) each row's splits are read by this many warps, otherwise by the fewest.
DECODE_COMBINE_WARPS = (4, 16)  # (many rows, fewer rows than SMs)


def decode_combine_config(dtype: str, total_rows: int, sm_count: int) -> DecodeCombine:
    """The merge of a split decoding call's ``total_rows`` rows (batch x Hq x queries)."""
    return DecodeCombine(dtype, DECODE_COMBINE_WARPS[total_rows < sm_count])


def all_decode_variants():
    """Every decoding kernel the dispatcher can launch (the same on every architecture)."""
    variants = [DecodeCombine(dtype, warps) for dtype in _constants.TENSOR_CORE_DTYPES for warps in DECODE_COMBINE_WARPS]
    for dtype in _constants.TENSOR_CORE_DTYPES:
        for hd in _tiles.DECODE_HEAD_DIM_BUCKETS:
            for paged in (False, True):
                for row_warps in _tiles.DECODE_ROW_WARPS:
                    variants.append(decode_config(dtype, hd, hd, paged, _constants.DECODE_ROW_TILE * row_warps))
                for (bucket, row_warps), tiles in _tiles.DECODE_TILES_SHORT.items():
                    if bucket == hd:
                        variants.append(SplitKvDecode(dtype, hd, *tiles, paged, row_warps))
    return variants
