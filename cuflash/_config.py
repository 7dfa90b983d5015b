"""Tile sizes and kernel variants: the one place where they are chosen.

The kernels take every size as a template argument, and the numbers fixed for all of them
(padding, limits, flag bits, the Hopper kernels' CTA shapes) as defines from
:func:`kernel_defines`, so a number chosen here is never written again in CUDA. The shared
memory of each 16-bit variant is computed here and passed as its last template argument; the
kernel's own layout (``FwdSmemLayout`` in kernels/flash_fwd.cu, ...) must come to the same size
(a static_assert, so a drift fails the build) and the kernel traps if a launch gives it less.

Tile sizes follow the paper's line 1 (blocks sized to the on-chip memory) refined by the
register budget of the mma.sync layout: each warp owns 16 query rows and keeps its slice of O
(16 x head_dim fp32) and of S (16 x block_cols fp32) in registers. Wide heads therefore get
fewer rows per CTA and narrower key tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # one 16-byte vector of a 16-bit type
# Head dims are rounded up to one of these buckets; padded columns are zero-filled on load.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)

# The numbers below are shared with the kernels, which get them from kernel_defines() as -D
# defines (so they are written only here; changing one changes the compile options, and with
# them CuPy's disk-cache key).
SMEM_PAD = 8  # elements of padding per shared-memory row of the mma.sync kernels (kSmemPad)
MAX_LEAD_DIMS = 4  # leading (batch) dims a launch takes once those that can be merged are (kMaxLead)
PARTIAL_TILE = 1 << 30  # flag bit of a tile-list entry whose tile needs the element mask (kPartialTile)
# The backward's per-row statistics (lse2, D) are padded to a multiple of this many rows; the
# kernels check that their query tiles divide it (kStatsRowMultiple).
STATS_ROW_MULTIPLE = 128

_TYPE_TAG = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}


_TAG_WITH_FLOAT = dict(_TYPE_TAG, float32="float")


def _instance(kernel: str, *args) -> str:
    """The name expression of an instance of a kernel template: a dtype as its C++ type, a bool
    as true / false, a number as it is."""
    def argument(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        return _TAG_WITH_FLOAT[value] if isinstance(value, str) else str(value)

    return f"cuflash::{kernel}<{', '.join(map(argument, args))}>"


# Words and prefixes of variant keys: the dtype's short name, and a short prefix for each
# numeric field (a true bool field reads as its name, a false one is left out).
_DTYPE_WORD = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_KEY_PREFIX = {"head_dim": "d", "head_dim_v": "dv", "block_rows": "br", "block_cols": "bc", "warps": "w",
               "min_blocks": "mb", "qk_unroll": "u", "stages": "s", "value_tiles": "dvt", "rows_per_warp": "rpw",
               "dim_tiles": "dt", "keys_per_warp": "kpw", "warps_s_rows": "ws", "warps_kv_rows": "wkv",
               "warps_dq_rows": "wdq", "k_unroll_s": "us", "k_unroll_o": "uo", "row_warps": "rw"}


class _Launch:
    """What every kernel variant shares: a CTA of ``warps`` warps, and a key built from its
    fields, e.g. ``fwd_sm90_bf16_d128_bc128_s3_tma_persistent_causal``."""

    warps: int
    key_prefix: str  # what kind of kernel: fwd, fwd_sm90, bwd_dq, ...

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def key(self) -> str:
        numbers, words = [], []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool):
                words += [field.name] if value else []
            elif field.name != "dtype":
                numbers.append(f"{_KEY_PREFIX[field.name]}{value}")
        return "_".join([self.key_prefix, _DTYPE_WORD[self.dtype], *numbers, *words])


def head_dim_bucket(dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds {MAX_HEAD_DIM}")


@dataclasses.dataclass(frozen=True)
class TensorCoreForward(_Launch):
    """A float16/bfloat16 forward variant (kernels/flash_fwd.cu, ``flash_fwd_kernel``)."""

    dtype: str
    head_dim: int  # padded head dim of q/k (HD)
    head_dim_v: int  # padded head dim of v (HDV)
    block_rows: int  # BR: query rows per CTA, a multiple of 16 per warp
    block_cols: int  # BC: keys per tile
    warps: int
    min_blocks: int  # CTAs per SM promised to the register allocator (__launch_bounds__)
    causal: bool
    qk_unroll: int = 2  # unroll of the QK^T k-loop when a warp holds several row tiles
    sparse: bool = False  # walks block-sparse tile lists (FwdParams::tile_lists)
    varlen: bool = False  # a packed variable-length batch (FwdParams::cu_seqlens_q, kernels/slice.cuh)

    source = "flash_fwd.cu"
    key_prefix = "fwd"

    # The block-sparse 256 x 32 forms at head dim 128 sat at the default budget (48 bytes on
    # sm_90a, 20 on sm_80, ba96d6a); the sequence geometry the varlen forms share took them to
    # 52 and 32. On Hopper they run only with the wgmma forward switched off (sparse head dim
    # 128 dispatches HopperForward), so they get 16 bytes of room rather than a new tile shape.
    @property
    def spill_allowance(self) -> int:
        return 64 if self.sparse and self.head_dim == 128 else 0

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        q_pitch = max(self.head_dim, self.head_dim_v) + SMEM_PAD
        k_pitch = self.head_dim + SMEM_PAD
        v_pitch = self.head_dim_v + SMEM_PAD
        elems = self.block_rows * q_pitch + 2 * self.block_cols * (k_pitch + v_pitch)
        return 2 * elems

    @property
    def name_expression(self) -> str:
        return _instance("flash_fwd_kernel", self.dtype, self.head_dim, self.head_dim_v, self.block_rows,
                         self.block_cols, self.warps, self.min_blocks, self.causal, self.qk_unroll, self.sparse,
                         self.varlen, self.smem_bytes())


@dataclasses.dataclass(frozen=True)
class Float32Forward(_Launch):
    """The exact-fp32 forward variant (kernels/flash_fwd_f32.cu, ``flash_fwd_f32_kernel``)."""

    value_tiles: int  # DVT: O columns per lane, ceil(dv / 32)
    causal: bool
    warps: int = 4
    rows_per_warp: int = 8
    sparse: bool = False
    varlen: bool = False

    source = "flash_fwd_f32.cu"
    key_prefix = "fwd"
    dtype = "float32"
    block_cols = 32  # one key per lane

    @property
    def block_rows(self) -> int:
        return self.warps * self.rows_per_warp

    def smem_bytes(self, d: int, dv: int = 0) -> int:
        elems = self.block_rows * d + self.block_cols * (d + 1) + self.block_cols * 32 * self.value_tiles
        return 4 * elems

    @property
    def name_expression(self) -> str:
        return _instance("flash_fwd_f32_kernel", self.value_tiles, self.warps, self.rows_per_warp, self.causal,
                         self.sparse, self.varlen)


@dataclasses.dataclass(frozen=True)
class HopperForward(_Launch):
    """A float16/bfloat16 forward on wgmma, sm_90a only (kernels/flash_fwd_sm90.cu): a producer
    warpgroup fills a ring of ``stages`` K/V buffers, two consumer warpgroups own 64 query rows each."""

    dtype: str
    head_dim: int  # d = dv = head_dim exactly (64, 128 or 256)
    block_cols: int
    stages: int
    overlap: bool  # S of the next tile issued before P V of this one
    pingpong: bool  # the two consumer warpgroups take turns issuing matmuls
    tma: bool  # bulk tensor copies (needs tensor maps: cuflash/_tma.py), else cp.async
    persistent: bool  # one CTA per SM walks (query tile, slice) items; the next item's loads
    # overlap this one's epilogue
    causal: bool
    sparse: bool = False
    varlen: bool = False  # a packed variable-length batch (never persistent: one slice a CTA)

    source = "flash_fwd_sm90.cu"
    key_prefix = "fwd_sm90"
    block_rows = 128  # both, like HopperBackward's, reach the kernel through kernel_defines()
    warps = 12
    # The producer warpgroup runs with 40 registers a thread (at 24 its copy loop spilled 120
    # bytes); the persistent head-dim-128 forms still spill up to 64 bytes. At 256, where O is
    # 128 of a consumer's 232 registers, up to 144; it still runs at 1.8x the mma.sync kernel
    # (bench/NOTES.md).
    @property
    def spill_allowance(self) -> int:
        return 160 if self.head_dim == 256 else 128

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        tiles = 2 * self.head_dim * (self.block_rows + 2 * self.stages * self.block_cols)
        barriers = 8 * (2 + 4 * self.stages)
        return tiles + barriers + 1024  # Sm90SmemLayout: 1024 of slack to align the tiles

    @property
    def name_expression(self) -> str:
        return _instance("flash_fwd_sm90_kernel", self.dtype, self.head_dim, self.block_cols, self.stages,
                         self.overlap, self.pingpong, self.tma, self.persistent, self.causal, self.sparse,
                         self.varlen, self.smem_bytes())


# (block_cols, stages, overlap, pingpong, persistent) of the wgmma forward per head dim. Its
# consumers hold S (64 x block_cols fp32, exponentiated in place), P (16-bit, the tile in P V)
# and O (64 x head_dim fp32) in the 240 registers a thread they take from the producer. Every
# form loads through TMA; the launch falls back to cp.async where the copy engine cannot map
# the inputs, and to one item a CTA where the persistent grid's 32-bit item count would not do. Overlap (S of t + 1 issued before P V of t, softmax of
# t + 1 while P V of t runs) with ping-pong is the fastest at hdim 64 (331 against 324 TFLOP/s
# at seq 4096, 435 against 408 at 16k); at hdim 128 neither helps (506 against 507 at 4096, 591
# against 564 at 16k), bench/NOTES.md.
#
# persistent: True, False, or an int n: the persistent form (one CTA per SM walking the work
# items) runs when a head has at most n query tiles of 128 rows. It wins at seq 512-1024, where
# a CTA's ring fills and drains in a handful of key tiles; from 4096 the one-item-a-CTA grid
# was as fast or faster (causal: 447 against 528 TFLOP/s at hdim 128, seq 16k: its fixed
# round-robin of items, longest query tiles first, balances worse than the hardware handing a
# free SM the next CTA; but the non-causal forms, whose items are equal, lost too, so balance
# is not all of it: bench/NOTES.md, sixth session).
#
# Head dim 256: 64-key tiles and 2 stages (Q and a stage of K and V are 128 KB of shared
# memory; O is 128 of a consumer thread's 232 registers), with ping-pong: 456 against 417
# TFLOP/s at seq 4096, 567 against 520 at 16k (overlap on top: 454 and 554), 8cbec78. Never
# persistent: at seq 1024 that was 292 against 313 (13d71f8), and its forms spill 120-188 bytes.
_SM90_FORWARD_TILES = {64: (128, 3, True, True, 8), 128: (128, 3, False, False, 8), 256: (64, 2, False, True, False)}
# The switch wgmma_forward() flips; CUFLASH_WGMMA=0 in the environment starts with it off.
_wgmma_forward = [os.environ.get("CUFLASH_WGMMA", "1") != "0"]


# Bumped whenever a switch or a table override changes what the dispatcher picks: cached
# launch plans (cuflash/_plan.py) carry the generation they were built in.
GENERATION = [0]


@contextlib.contextmanager
def _switched(switch: list, enabled: bool):
    """Temporarily set a module switch (a one-element list)."""
    saved = switch[0]
    switch[0] = bool(enabled)
    GENERATION[0] += 1
    try:
        yield
    finally:
        switch[0] = saved
        GENERATION[0] += 1


def wgmma_forward(enabled: bool):
    """Turn the wgmma forward on or off (on by default where the GPU has it), e.g. to compare
    it with the mma.sync kernel on the same H100/H200 in one process."""
    return _switched(_wgmma_forward, enabled)


# (block_rows, block_cols, warps, min_blocks) per head-dim bucket for the 16-bit forward.
# A warp holds (block_rows / warps / 16) row tiles; per thread O costs head_dim / 8 * 4 fp32
# registers per row tile and S block_cols / 8 * 4, which is what bounds these choices.
_TC_FORWARD_TILES = {
    32: (128, 64, 4, 1, 4),
    64: (128, 64, 4, 1, 4),  # 322 TFLOP/s at seq 4096 on the H200 (bench/NOTES.md)
    96: (128, 64, 8, 1),
    128: (256, 32, 8, 1, 4),  # 293 TFLOP/s; (128, 32, 4, 1) is faster causal but spills
    160: (128, 32, 8, 1),
    192: (128, 32, 8, 1),
    224: (64, 16, 4, 1),  # 32-key tiles spill at 224 and 256: O alone is 112-128 registers
    256: (64, 16, 4, 1),
}


def forward_config(dtype: str, d: int, dv: int, causal: bool, *, tiles=None, sparse: bool = False,
                   wgmma: bool = False, nq: typing.Optional[int] = None, tma: bool = True,
                   slices: int = 1, varlen: bool = False):
    """The kernel variant the dispatcher runs for these arguments.

    ``tiles`` = (block_rows, block_cols, warps, min_blocks[, qk_unroll]) overrides the table
    (used by tuning runs). ``sparse``: the launch walks block-sparse tile lists. ``wgmma``: the
    GPU has wgmma (:func:`has_wgmma`); head dims 64 and 128 (d = dv) then run on it. ``nq``:
    the query length, which picks the wgmma forward's persistent form or not. ``tma``: whether
    the copy engine can map q, k and v (else the wgmma forward loads with cp.async).
    ``slices``: the launch's (batch..., head) slices; a persistent grid counts its items
    (query tiles x slices) in 32 bits, so past 2^31 items it runs one item a CTA.
    ``varlen``: a packed variable-length batch: the same tiles in their VARLEN form (never
    block-sparse, and on wgmma never persistent: a CTA keeps one sequence and head).
    """
    if varlen:
        variant = forward_config(dtype, d, dv, causal, tiles=tiles, wgmma=wgmma, nq=nq, tma=tma, slices=slices)
        extra = {"persistent": False} if isinstance(variant, HopperForward) else {}
        return dataclasses.replace(variant, varlen=True, **extra)
    if wgmma and tiles is None and _wgmma_forward[0] and dtype in _TYPE_TAG and d == dv and d in _SM90_FORWARD_TILES:
        *schedule, persistent = _SM90_FORWARD_TILES[d]
        q_tiles = None if nq is None else -(-nq // HopperForward.block_rows)
        if not isinstance(persistent, bool):
            persistent = q_tiles is not None and q_tiles <= persistent
        if q_tiles is not None and q_tiles * slices >= 2**31:
            persistent = False
        return HopperForward(dtype, d, *schedule, bool(tma), persistent, bool(causal), sparse=bool(sparse))
    if dtype == "float32":
        value_tiles = -(-dv // 32)
        # O holds rows_per_warp x value_tiles fp32 registers a lane; keep it near 16-32.
        rows_per_warp = 8 if value_tiles <= 2 else 4 if value_tiles <= 4 else 2
        return Float32Forward(value_tiles, bool(causal), rows_per_warp=rows_per_warp, sparse=bool(sparse))
    hd = head_dim_bucket(max(d, dv))  # one bucket for both keeps the variant count small
    br, bc, warps, mb, *unroll = tiles or _TC_FORWARD_TILES[hd]
    return TensorCoreForward(dtype, hd, hd, br, bc, warps, mb, bool(causal), *unroll, sparse=bool(sparse))


def all_forward_variants(wgmma: bool = False):
    """Every variant the dispatcher can pick (what the offline compile check builds)."""
    variants = []
    if wgmma:
        for sparse in (False, True):
            for causal in (False, True):
                for dtype in ("float16", "bfloat16"):
                    for hd in sorted(_SM90_FORWARD_TILES):
                        # Short and long queries (persistent or not, where the table switches
                        # on length), and the forms the dispatcher falls back to: cp.async for
                        # inputs the copy engine cannot map, one item a CTA past 2^31 items.
                        forms = set()
                        for nq in (1, 2**30):
                            variant = forward_config(dtype, hd, hd, causal, sparse=sparse, wgmma=True, nq=nq)
                            forms |= {variant, dataclasses.replace(variant, tma=False),
                                      dataclasses.replace(variant, persistent=False),
                                      dataclasses.replace(variant, tma=False, persistent=False)}
                        variants += sorted(forms, key=lambda v: v.key)
                        if not sparse:  # varlen: one item a CTA, TMA or cp.async
                            packed = forward_config(dtype, hd, hd, causal, wgmma=True, varlen=True)
                            variants += [packed, dataclasses.replace(packed, tma=False)]
    for sparse in (False, True):
        for causal in (False, True):
            for dtype in ("float16", "bfloat16"):
                for hd in HEAD_DIM_BUCKETS:
                    variants.append(forward_config(dtype, hd, hd, causal, sparse=sparse))
                    if not sparse:
                        variants.append(forward_config(dtype, hd, hd, causal, varlen=True))
            for dvt in range(1, MAX_HEAD_DIM // 32 + 1):
                variants.append(forward_config("float32", 32 * dvt, 32 * dvt, causal, sparse=sparse))
                if not sparse:
                    variants.append(forward_config("float32", 32 * dvt, 32 * dvt, causal, varlen=True))
    return variants


@contextlib.contextmanager
def _table_override(table, entries):
    """Temporarily update a tile table (for tuning runs that compare tiles in one process)."""
    saved = dict(table)
    table.update(entries)
    GENERATION[0] += 1
    try:
        yield
    finally:
        table.clear()
        table.update(saved)
        GENERATION[0] += 1


def forward_tiles_override(tiles_by_bucket):
    """Temporarily replace _TC_FORWARD_TILES entries
    {head_dim_bucket: (block_rows, block_cols, warps, min_blocks[, qk_unroll])}."""
    return _table_override(_TC_FORWARD_TILES, tiles_by_bucket)


# ---- backward -----------------------------------------------------------------------------



@dataclasses.dataclass(frozen=True)
class BackwardPreprocess(_Launch):
    """D = rowsum(dO * O) and lse2 per query row (``flash_bwd_preprocess``)."""

    dtype: str
    warps: int = 8  # one row per warp
    varlen: bool = False

    source = "flash_bwd.cu"
    key_prefix = "bwd_pre"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        return 0

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_preprocess", self.dtype, self.warps, self.varlen)


@dataclasses.dataclass(frozen=True)
class TensorCoreBackward(_Launch):
    """dK, dV (and atomic dQ) for float16/bfloat16 (``flash_bwd_kernel``), one CTA per key tile.

    Each of the kernel's matmuls spreads the warps over its output tile in two dimensions:
    ``warps_s_rows`` along the queries of S / dP, ``warps_kv_rows`` along the keys of dK / dV,
    ``warps_dq_rows`` along the queries of dQ (the rest of the warps along the other side).
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    block_rows: int  # BR: queries per tile walked
    block_cols: int  # BC: keys per CTA
    warps: int
    min_blocks: int
    causal: bool
    do_dk: bool
    do_dv: bool
    atomic_dq: bool
    warps_s_rows: int = 2
    warps_kv_rows: int = 4
    warps_dq_rows: int = 2
    k_unroll_s: int = 1  # unroll of the k-loops of S and dP
    k_unroll_o: int = 1  # ... and of dV, dK and dQ
    sparse: bool = False
    varlen: bool = False

    source = "flash_bwd.cu"
    key_prefix = "bwd"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        k_pitch, v_pitch = self.head_dim + SMEM_PAD, self.head_dim_v + SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        elems = bc * k_pitch + bc * v_pitch + 2 * br * k_pitch + 2 * br * v_pitch + 2 * br * (bc + SMEM_PAD)
        return 4 * 3 * 2 * br + 2 * elems  # (m, log2 l) and D per query row, two stages

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_kernel", self.dtype, self.head_dim, self.head_dim_v, self.block_rows,
                         self.block_cols, self.warps, self.min_blocks, self.causal, self.do_dk, self.do_dv,
                         self.atomic_dq, self.warps_s_rows, self.warps_kv_rows, self.warps_dq_rows,
                         self.k_unroll_s, self.k_unroll_o, self.sparse, self.varlen, self.smem_bytes())


@dataclasses.dataclass(frozen=True)
class TensorCoreBackwardDq(_Launch):
    """Deterministic dQ for float16/bfloat16 (``flash_bwd_dq_kernel``), one CTA per query tile."""

    dtype: str
    head_dim: int
    head_dim_v: int
    block_rows: int
    block_cols: int
    warps: int
    min_blocks: int
    causal: bool
    sparse: bool = False
    varlen: bool = False

    source = "flash_bwd.cu"
    key_prefix = "bwd_dq"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        k_pitch, v_pitch = self.head_dim + SMEM_PAD, self.head_dim_v + SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        return 2 * (br * k_pitch + br * v_pitch + 2 * bc * k_pitch + 2 * bc * v_pitch)

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_dq_kernel", self.dtype, self.head_dim, self.head_dim_v, self.block_rows,
                         self.block_cols, self.warps, self.min_blocks, self.causal, self.sparse, self.varlen,
                         self.smem_bytes())


@dataclasses.dataclass(frozen=True)
class Float32BackwardDkDv(_Launch):
    """Exact-fp32 dK, dV (``flash_bwd_dkdv_f32_kernel``)."""

    dim_tiles: int  # DT = DVT = ceil(max(d, dv) / 32)
    causal: bool
    warps: int = 4
    keys_per_warp: int = 4
    sparse: bool = False
    varlen: bool = False

    source = "flash_bwd_f32.cu"
    key_prefix = "bwd_dkdv"
    dtype = "float32"
    block_rows = 32  # queries per tile walked: one per lane

    @property
    def block_cols(self) -> int:
        return self.warps * self.keys_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        bk, pitch = self.block_cols, 32 * self.dim_tiles + 1
        return 4 * (bk * d + bk * dv + 2 * 32 * pitch)

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_dkdv_f32_kernel", self.dim_tiles, self.dim_tiles, self.warps,
                         self.keys_per_warp, self.causal, self.sparse, self.varlen)


@dataclasses.dataclass(frozen=True)
class Float32BackwardDq(_Launch):
    """Exact-fp32 dQ (``flash_bwd_dq_f32_kernel``)."""

    dim_tiles: int
    causal: bool
    warps: int = 4
    rows_per_warp: int = 8
    sparse: bool = False
    varlen: bool = False

    source = "flash_bwd_f32.cu"
    key_prefix = "bwd_dq"
    dtype = "float32"
    block_cols = 32  # keys per tile walked: one per lane

    @property
    def block_rows(self) -> int:
        return self.warps * self.rows_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        br = self.block_rows
        return 4 * (br * d + br * dv + 32 * (32 * self.dim_tiles + 1) + 32 * (dv + 1))

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_dq_f32_kernel", self.dim_tiles, self.warps, self.rows_per_warp, self.causal,
                         self.sparse, self.varlen)


# (query rows per tile, keys per CTA, warps, min_blocks, warps along S's queries, along dK/dV's
# keys, along dQ's queries) of flash_bwd_kernel per bucket. Per thread, dK and dV cost
# block_cols * head_dim / (32 * warps) fp32 registers each; above 128 the two are computed in
# separate passes, so only one of them is live.
_TC_BACKWARD_TILES = {
    32: (128, 128, 8, 1, 4, 8, 4),
    64: (64, 128, 8, 1, 2, 4, 2),
    96: (64, 128, 8, 1, 2, 4, 4),
    128: (64, 128, 8, 1, 2, 4, 2),
    160: (64, 64, 8, 1, 2, 4, 4),
    192: (64, 64, 8, 1, 2, 4, 4),
    256: (32, 64, 8, 1, 2, 4, 2),  # 224 runs as 256: 224 = 14 x 16 splits over 2 or 7 warps only
}
# Before Hopper a CTA gets at most 163 KB of shared memory (A100), and sm_80's register
# allocation spills the 128 x 128 dK/dV tiles: smaller key tiles there.
_TC_BACKWARD_TILES_PRE_HOPPER = {
    128: (64, 64, 8, 1, 2, 4, 2),
    192: (32, 64, 8, 1, 2, 4, 2),
}
# (query rows per CTA, keys per tile, warps, min_blocks) of the deterministic dQ kernel.
_TC_BACKWARD_DQ_TILES = {
    32: (128, 64, 8, 1),
    64: (128, 64, 8, 1),
    96: (128, 32, 8, 1),  # causal 64-key tiles spill at 128 (dQ, S and dP all live)
    128: (128, 32, 8, 1),
    160: (64, 32, 4, 1),
    192: (64, 16, 4, 1),  # dQ alone is 96-128 registers a thread: keep S and dP small
    224: (64, 16, 4, 1),
    256: (64, 16, 4, 1),
}
SPLIT_BACKWARD_ABOVE = 128  # head dims above this compute dV and dK in separate passes


@dataclasses.dataclass(frozen=True)
class HopperBackward(_Launch):
    """The key-tile pass of the backward on wgmma, sm_90a only (kernels/flash_bwd_sm90.cu);
    the default for 16-bit d = dv in {64, 128} there (CUFLASH_WGMMA_BWD=0 or
    wgmma_backward(False) for the mma.sync pass). One CTA per 128 keys walks query tiles of 64;
    a producer warpgroup and two consumer warpgroups of 64 keys. With deterministic dQ the
    mma.sync dQ kernel follows it."""

    dtype: str
    head_dim: int  # d = dv = head_dim exactly (64 or 128)
    atomic_dq: bool
    causal: bool
    stages: int = 2
    sparse: bool = False
    bulk_dq: bool = False  # atomic dQ added by one bulk reduction per tile instead of vector atomics
    varlen: bool = False

    source = "flash_bwd_sm90.cu"
    key_prefix = "bwd_sm90"
    block_rows = 64
    block_cols = 128
    warps = 12
    # No allowance of its own: every variant spills at most 24 bytes (dense, hd128, atomic dQ).
    # The block-sparse ones at head dim 128 with atomic dQ spilled 132-204 while the partial
    # tiles' block look-ups sat inside the P^T loop (on top of dK, dV and dQ in 232 registers);
    # they are a mask built before it now (partial_tile_keep, mask.cuh), and spill 0-16.

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        hd, br, bc = self.head_dim, self.block_rows, self.block_cols
        tiles = 2 * (2 * bc * hd + 2 * self.stages * br * hd + 2 * bc * br)  # K, V; Q, dO a stage; dS^T twice
        dq_tile = 4 * br * 128  # fp32, for bulk_dq: hd128's tile, or hd64's two (one a warpgroup)
        return tiles + self.stages * 3 * br * 4 + dq_tile + 8 * (1 + 2 * self.stages) + 1024

    @property
    def name_expression(self) -> str:
        return _instance("flash_bwd_sm90_kernel", self.dtype, self.head_dim, self.stages, self.atomic_dq,
                         self.causal, self.sparse, self.bulk_dq, self.varlen, self.smem_bytes())


# Per head dim: the wgmma backward's atomic dQ added tile by tile by one bulk reduction on the
# copy engine (True) or by vector atomics from registers (False). Measured (bench/NOTES.md,
# 8cbec78): +7-11% at head dim 128; -4-8% at 64, where each warpgroup adds its own tile and the
# copy engine's two reductions a tile cost more than the atomics they replace.
_SM90_BULK_DQ = {64: False, 128: True}


# The switch wgmma_backward() flips; CUFLASH_WGMMA_BWD=0 in the environment starts with it off.
_wgmma_backward = [os.environ.get("CUFLASH_WGMMA_BWD", "1") != "0"]


def wgmma_backward(enabled: bool):
    """Turn the wgmma backward key pass on or off (on by default where the GPU has wgmma)."""
    return _switched(_wgmma_backward, enabled)


class BackwardPlan(typing.NamedTuple):
    preprocess: BackwardPreprocess
    key_passes: tuple  # kernels launched over key tiles
    dq: object  # a kernel launched over query tiles, or None when dQ is accumulated atomically
    atomic_dq: bool


def backward_plan(dtype: str, d: int, dv: int, causal: bool, deterministic: bool, *,
                  hopper: bool = True, sparse: bool = False, wgmma: bool = False,
                  wgmma_backward_on: typing.Optional[bool] = None, varlen: bool = False) -> BackwardPlan:
    """The kernels one backward launches; ``hopper``: the GPU has compute capability >= 9.0;
    ``sparse``: they walk block-sparse tile lists; ``wgmma``: the GPU has wgmma, and the
    wgmma key pass is switched on (``wgmma_backward_on``, default the module switch);
    ``varlen``: a packed variable-length batch, every kernel in its VARLEN form (never sparse)."""
    if varlen:
        plan = backward_plan(dtype, d, dv, causal, deterministic, hopper=hopper, wgmma=wgmma,
                             wgmma_backward_on=wgmma_backward_on)

        def packed(kernel):
            return None if kernel is None else dataclasses.replace(kernel, varlen=True)

        return BackwardPlan(packed(plan.preprocess), tuple(map(packed, plan.key_passes)), packed(plan.dq),
                            plan.atomic_dq)
    causal, sparse = bool(causal), bool(sparse)
    pre = BackwardPreprocess(dtype)
    on = _wgmma_backward[0] if wgmma_backward_on is None else wgmma_backward_on
    if wgmma and on and dtype in _TYPE_TAG and d == dv and d in (64, 128):
        dq = None if not deterministic else TensorCoreBackwardDq(dtype, d, d, *_TC_BACKWARD_DQ_TILES[d], causal, sparse)
        key_pass = HopperBackward(dtype, d, not deterministic, causal, sparse=sparse,
                                  bulk_dq=_SM90_BULK_DQ[d] and not deterministic)
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
    hd_keys = hd if hd in _TC_BACKWARD_TILES else head_dim_bucket(hd + 1)
    atomic = not deterministic
    tiles = _TC_BACKWARD_TILES if hopper else {**_TC_BACKWARD_TILES, **_TC_BACKWARD_TILES_PRE_HOPPER}
    br, bc, warps, mb, *layout = tiles[hd_keys]

    def key_pass(do_dk, do_dv, atomic_dq):
        return TensorCoreBackward(dtype, hd_keys, hd_keys, br, bc, warps, mb, causal, do_dk, do_dv, atomic_dq,
                                  *layout, sparse=sparse)

    if hd <= SPLIT_BACKWARD_ABOVE:
        passes = (key_pass(True, True, atomic),)
    else:
        passes = (key_pass(False, True, atomic), key_pass(True, False, False))
    dq = None if atomic else TensorCoreBackwardDq(dtype, hd, hd, *_TC_BACKWARD_DQ_TILES[hd], causal, sparse)
    return BackwardPlan(pre, passes, dq, atomic)


def backward_tiles_override(tiles_by_bucket):
    """Temporarily replace _TC_BACKWARD_TILES entries (tuning runs, like forward_tiles_override)."""
    return _table_override(_TC_BACKWARD_TILES, tiles_by_bucket)


def all_backward_variants(hopper: bool = True, wgmma: bool = False):
    variants = {}
    if wgmma:
        for causal in (False, True):
            for dtype in _TYPE_TAG:
                for dim in (64, 128):
                    for deterministic in (False, True):
                        for sparse, varlen in ((False, False), (True, False), (False, True)):
                            plan = backward_plan(dtype, dim, dim, causal, deterministic, hopper=hopper,
                                                 sparse=sparse, wgmma=True, wgmma_backward_on=True, varlen=varlen)
                            for kernel in (*plan.key_passes, plan.dq):
                                if kernel is not None:
                                    variants[kernel.key] = kernel
    for causal in (False, True):
        for dtype in SUPPORTED_DTYPES:
            for dim in (HEAD_DIM_BUCKETS if dtype != "float32" else range(32, MAX_HEAD_DIM + 1, 32)):
                for deterministic in (False, True):
                    for sparse, varlen in ((False, False), (True, False), (False, True)):
                        plan = backward_plan(dtype, dim, dim, causal, deterministic, hopper=hopper, sparse=sparse,
                                             wgmma_backward_on=False, varlen=varlen)
                        for kernel in (plan.preprocess, *plan.key_passes, plan.dq):
                            if kernel is not None:
                                variants[kernel.key] = kernel
    return list(variants.values())


def all_variants(hopper: bool = True, wgmma: typing.Optional[bool] = None):
    """Every kernel variant the dispatcher can launch on a GPU of that kind, forward and backward.
    ``wgmma`` defaults to ``hopper``."""
    wgmma = hopper if wgmma is None else wgmma
    reduces = [GradientReduce(dtype) for dtype in SUPPORTED_DTYPES]
    return all_forward_variants(wgmma) + all_backward_variants(hopper, wgmma) + reduces + all_decode_variants()


def variants_for(arch: str):
    """all_variants() for one architecture ('sm_80', 'sm_90a', or a compute capability '90')."""
    return all_variants(is_hopper(arch), has_wgmma(arch))


def _capability(arch: str) -> int:
    """'sm_90a' / '90' -> 90."""
    return int("".join(c for c in arch if c.isdigit()))


def has_wgmma(arch: str) -> bool:
    """'sm_90a' / '90' -> True: wgmma exists on compute capability 9.0 only (sm_90a code)."""
    return _capability(arch) == 90


def is_hopper(arch: str) -> bool:
    """'sm_90a' / '90' (compute capability) -> True; 'sm_80' / '86' -> False."""
    return _capability(arch) >= 90


@dataclasses.dataclass(frozen=True)
class GradientReduce(_Launch):
    """The backward's last step for float32 accumulators (kernels/grad_reduce.cu): sums the
    slices of grouped heads (1 for dQ) and stores the gradient in the input dtype."""

    dtype: str
    warps: int = 8

    source = "grad_reduce.cu"
    elements_per_thread = 4  # one float4 a step

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        return 0

    key_prefix = "grad_reduce"

    @property
    def name_expression(self) -> str:
        return _instance("grad_reduce_kernel", self.dtype, self.warps)


# ---- decoding: split-KV with grouped heads packed (kernels/flash_decode.cu) -----------------------
#
# A few queries a head against a long cache: the keys of each (batch, k/v head) are split over
# CTAs so that every SM streams K and V, and the query heads sharing a k/v head are packed into
# one tile of 16, 32 or 64 rows. The kernel is bound by device memory, not by the tensor cores: what a tile
# size buys is bytes in flight. Per CTA, STAGES - 1 tiles of BC keys (K and V, 2 * BC * hd * 2
# bytes each) are in flight while one is computed.

DECODE_ROW_TILE = 16  # packed query rows a warp (kDecodeRows in flash_decode.cu)
DECODE_PAGE_GROUP = 16  # keys a page-table look-up covers (kPageGroup): the smallest page size
MAX_DECODE_QUERIES = 16  # queries a head the decoding kernels take (Nq)
DECODE_PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_DECODE_SPLITS = 256
# Head dims (any multiple of 8 up to 128) are padded (zero-filled) up to one of these. 256 is
# not offered: with O (16 x 256 fp32 a warp) at 128 registers a thread, the 64-key tile
# spilled 144-180 bytes (sm_80 and sm_90a, two stages); it needs O's columns split over warps.
DECODE_HEAD_DIM_BUCKETS = (64, 128)
# Splits aim at this many waves of CTAs (resident CTAs on every SM) ...
DECODE_TARGET_WAVES = 2
# ... with the last wave at least this full on average ...
DECODE_WAVE_FILL = 0.9
# ... while each split keeps at least this many key tiles, so that its pipeline fills and the
# workspace and combine stay small next to the cache it streams.
DECODE_MIN_TILES_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class SplitKvDecode(_Launch):
    """The split-KV decoding kernel (``flash_decode_kernel``): block_rows packed query rows of
    one (batch, k/v head) against one split of its keys. The warps form row_warps x
    (warps / row_warps): each owns 16 rows and block_cols / (warps / row_warps) keys of every
    tile; ``stages`` cp.async buffers."""

    dtype: str
    head_dim: int  # bucket of max(d, dv)
    block_cols: int  # keys a tile
    warps: int
    stages: int
    paged: bool
    row_warps: int  # 16-row tiles a CTA

    source = "flash_decode.cu"

    @property
    def block_rows(self) -> int:
        return DECODE_ROW_TILE * self.row_warps

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        """DecodeSmemLayout::bytes: Q, K and V stages (16-bit, padded rows) and the page slots
        of the stages plus one (int32)."""
        pitch = self.head_dim + SMEM_PAD
        tiles = 2 * (self.block_rows * pitch + 2 * self.stages * self.block_cols * pitch)
        return tiles + 4 * (self.stages + 1) * (self.block_cols // DECODE_PAGE_GROUP)

    key_prefix = "decode"

    @property
    def name_expression(self) -> str:
        return _instance("flash_decode_kernel", self.dtype, self.head_dim, self.block_cols, self.warps, self.stages,
                         self.paged, self.row_warps)


@dataclasses.dataclass(frozen=True)
class DecodeCombine(_Launch):
    """The merge of the splits' partial results (``flash_decode_combine_kernel``): one warp a row."""

    dtype: str
    warps: int = 4

    source = "flash_decode.cu"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        return 0

    key_prefix = "decode_combine"

    @property
    def name_expression(self) -> str:
        return _instance("flash_decode_combine_kernel", self.dtype, self.warps)


# (block_cols, warps, stages) per (head-dim bucket, row warps). Four warps; three stages, so
# two tiles are in flight a CTA while one is computed. A stage of K and V is 32 KB at one and
# two row warps (block_cols 128 at head dim 64, 64 at 128), and the shared memory of each form
# (<= 113 KB) lets two CTAs share an H100/H200 SM (228 KB, 1 KB of it reserved a CTA) and one
# an A100's. Four row warps hold 64 rows of Q, and their one key warp the whole tile's S:
# smaller tiles there (64 and 48 keys: 18 and 26 KB a stage) keep two CTAs an SM and S at 32
# or 24 registers. Predicted, not yet measured: Little's law at ~4.2 TB/s over 132 SMs and ~1
# us of latency asks ~32 KB in flight an SM; two CTAs keep 72-128 KB.
_DECODE_TILES = {
    (64, 1): (128, 4, 3), (64, 2): (128, 4, 3), (64, 4): (64, 4, 3),
    (128, 1): (64, 4, 3), (128, 2): (64, 4, 3), (128, 4): (48, 4, 3),
}


def decode_head_dim_bucket(dim: int) -> int:
    for bucket in DECODE_HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds {DECODE_HEAD_DIM_BUCKETS[-1]}")


# 16-row tiles a CTA, by packed rows (group x Nq): the fewest that hold them, up to one a warp.
# Rows past a CTA's go to further row-tile CTAs, which read the same keys again (from L2 when
# they run together), so more rows a CTA saves that traffic where rows are many (MQA, or
# GQA with several queries), while few rows keep every warp on its own keys.
DECODE_ROW_WARPS = (1, 2, 4)


def decode_row_warps(rows: int) -> int:
    for row_warps in DECODE_ROW_WARPS:
        if rows <= DECODE_ROW_TILE * row_warps:
            return row_warps
    return DECODE_ROW_WARPS[-1]


def decode_config(dtype: str, d: int, dv: int, paged: bool, rows: int = 1) -> SplitKvDecode:
    """The decoding variant for 16-bit ``dtype``, head dims d (q, k) and dv (v), ``rows``
    packed query rows (query heads a k/v head x queries a head)."""
    hd = decode_head_dim_bucket(max(d, dv))
    row_warps = decode_row_warps(rows)
    return SplitKvDecode(dtype, hd, *_DECODE_TILES[(hd, row_warps)], bool(paged), row_warps)


def decode_splits(ctas_per_split: int, key_tiles: int, sm_count: int, ctas_per_sm: int) -> typing.Tuple[int, int]:
    """(splits, key tiles a split) for ``key_tiles`` tiles of keys a sequence, where one split
    is ``ctas_per_split`` CTAs (batch x k/v heads x row tiles) and a wave ``sm_count`` x
    ``ctas_per_sm`` CTAs. Every split keeps at least DECODE_MIN_TILES_PER_SPLIT tiles (and
    there are at most MAX_DECODE_SPLITS). Of those counts, the fewest splits that give at least
    DECODE_TARGET_WAVES waves with the last wave DECODE_WAVE_FILL full on average (CTAs of one
    length finish together: 2.2 waves take as long as 3); failing that, the best-filled count
    that reaches the waves; failing that (short caches), as many splits as there may be."""
    key = (ctas_per_split, key_tiles, sm_count, ctas_per_sm)
    if key not in _decode_splits_memo:  # a decode loop asks for the same few shapes every step
        _decode_splits_memo[key] = _choose_decode_splits(*key)
    return _decode_splits_memo[key]


_decode_splits_memo: dict = {}


def _choose_decode_splits(ctas_per_split, key_tiles, sm_count, ctas_per_sm):
    if key_tiles <= 0:
        return 1, 1
    wave = sm_count * ctas_per_sm
    most = max(1, min(MAX_DECODE_SPLITS, key_tiles // DECODE_MIN_TILES_PER_SPLIT))
    best = None  # (fill, -splits, splits, per_split) of the counts that reach the waves
    for wanted in range(1, most + 1):
        per_split = -(-key_tiles // wanted)
        splits = -(-key_tiles // per_split)  # none left without a tile
        ctas = ctas_per_split * splits
        if ctas < DECODE_TARGET_WAVES * wave:
            continue
        fill = ctas / (-(-ctas // wave) * wave)  # of the waves it takes, how full on average
        if fill >= DECODE_WAVE_FILL:
            return splits, per_split
        best = max(best or (fill, -splits, splits, per_split), (fill, -splits, splits, per_split))
    if best is not None:
        return best[2], best[3]
    per_split = -(-key_tiles // most)
    return -(-key_tiles // per_split), per_split


def all_decode_variants():
    """Every decoding kernel the dispatcher can launch (the same on every architecture)."""
    variants = [DecodeCombine(dtype) for dtype in _TYPE_TAG]
    for dtype in _TYPE_TAG:
        for hd in DECODE_HEAD_DIM_BUCKETS:
            for paged in (False, True):
                for row_warps in DECODE_ROW_WARPS:
                    variants.append(decode_config(dtype, hd, hd, paged, DECODE_ROW_TILE * row_warps))
    return variants


def kernel_defines() -> dict:
    """{macro: value} of the numbers the kernels take from this module (kernels/common.cuh,
    tile_io.cuh, sm90.cuh, flash_fwd_sm90.cu, flash_bwd_sm90.cu), passed by
    _loader.base_options()."""
    from . import _tma  # the tensor maps' parameter block (numpy, ctypes): only when building
    return {
        "CUFLASH_SMEM_PAD": SMEM_PAD,
        "CUFLASH_MAX_LEAD": MAX_LEAD_DIMS,
        "CUFLASH_PARTIAL_TILE": PARTIAL_TILE,
        "CUFLASH_STATS_ROW_MULTIPLE": STATS_ROW_MULTIPLE,
        "CUFLASH_SM90_FWD_ROWS": HopperForward.block_rows,
        "CUFLASH_SM90_FWD_WARPS": HopperForward.warps,
        "CUFLASH_SM90_BWD_ROWS": HopperBackward.block_rows,
        "CUFLASH_SM90_BWD_KEYS": HopperBackward.block_cols,
        "CUFLASH_SM90_BWD_WARPS": HopperBackward.warps,
        "CUFLASH_SM90_MAPS_BYTES": _tma.PARAM_BYTES,
    }
