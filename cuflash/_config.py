"""Tile sizes and kernel variants: the one place where they are chosen.

The kernels take every size as a template argument, so a number chosen here is never written
again in CUDA. The shared-memory budget of each variant is computed here from the same layout
the kernel uses (``FwdSmemLayout`` in kernels/flash_fwd.cu), and the kernel traps if a launch
ever gives it less than it needs, so the two cannot drift silently.

Tile sizes follow the paper's line 1 (blocks sized to the on-chip memory) refined by the
register budget of the mma.sync layout: each warp owns 16 query rows and keeps its slice of O
(16 x head_dim fp32) and of S (16 x block_cols fp32) in registers. Wide heads therefore get
fewer rows per CTA and narrower key tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # one 16-byte vector of a 16-bit type
# Head dims are rounded up to one of these buckets; padded columns are zero-filled on load.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
SMEM_PAD = 8  # elements of padding per shared-memory row (kSmemPad in flash_fwd.cu)

_TYPE_TAG = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}


class _Launch:
    """What every kernel variant shares: a CTA of ``warps`` warps."""

    warps: int

    @property
    def threads(self) -> int:
        return 32 * self.warps


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

    source = "flash_fwd.cu"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        q_pitch = max(self.head_dim, self.head_dim_v) + SMEM_PAD
        k_pitch = self.head_dim + SMEM_PAD
        v_pitch = self.head_dim_v + SMEM_PAD
        elems = self.block_rows * q_pitch + 2 * self.block_cols * (k_pitch + v_pitch)
        return 2 * elems

    @property
    def name_expression(self) -> str:
        return (
            f"cuflash::flash_fwd_kernel<{_TYPE_TAG[self.dtype]}, {self.head_dim}, "
            f"{self.head_dim_v}, {self.block_rows}, {self.block_cols}, {self.warps}, "
            f"{self.min_blocks}, {'true' if self.causal else 'false'}, {self.qk_unroll}>"
        )

    @property
    def key(self) -> str:
        return (
            f"fwd_{self.dtype}_u{self.qk_unroll}_hd{self.head_dim}_hdv{self.head_dim_v}_br{self.block_rows}"
            f"_bc{self.block_cols}_w{self.warps}_mb{self.min_blocks}_causal_{str(self.causal).lower()}"
        )


@dataclasses.dataclass(frozen=True)
class Float32Forward(_Launch):
    """The exact-fp32 forward variant (kernels/flash_fwd_f32.cu, ``flash_fwd_f32_kernel``)."""

    value_tiles: int  # DVT: O columns per lane, ceil(dv / 32)
    causal: bool
    warps: int = 4
    rows_per_warp: int = 8

    source = "flash_fwd_f32.cu"
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
        return (
            f"cuflash::flash_fwd_f32_kernel<{self.value_tiles}, {self.warps}, "
            f"{self.rows_per_warp}, {'true' if self.causal else 'false'}>"
        )

    @property
    def key(self) -> str:
        return f"fwd_float32_dvt{self.value_tiles}_causal_{str(self.causal).lower()}"


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


def forward_config(dtype: str, d: int, dv: int, causal: bool, *, tiles=None):
    """The kernel variant the dispatcher runs for these arguments.

    ``tiles`` = (block_rows, block_cols, warps, min_blocks[, qk_unroll]) overrides the table
    (used by tuning runs).
    """
    if dtype == "float32":
        value_tiles = -(-dv // 32)
        # O holds rows_per_warp x value_tiles fp32 registers a lane; keep it near 16-32.
        rows_per_warp = 8 if value_tiles <= 2 else 4 if value_tiles <= 4 else 2
        return Float32Forward(value_tiles, bool(causal), rows_per_warp=rows_per_warp)
    hd = head_dim_bucket(max(d, dv))  # one bucket for both keeps the variant count small
    br, bc, warps, mb, *unroll = tiles or _TC_FORWARD_TILES[hd]
    return TensorCoreForward(dtype, hd, hd, br, bc, warps, mb, bool(causal), *unroll)


def all_forward_variants():
    """Every variant the dispatcher can pick (what the offline compile check builds)."""
    variants = []
    for causal in (False, True):
        for dtype in ("float16", "bfloat16"):
            for hd in HEAD_DIM_BUCKETS:
                variants.append(forward_config(dtype, hd, hd, causal))
        for dvt in range(1, MAX_HEAD_DIM // 32 + 1):
            variants.append(forward_config("float32", 32 * dvt, 32 * dvt, causal))
    return variants


@contextlib.contextmanager
def _table_override(table, entries):
    """Temporarily update a tile table (for tuning runs that compare tiles in one process)."""
    saved = dict(table)
    table.update(entries)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def forward_tiles_override(tiles_by_bucket):
    """Temporarily replace _TC_FORWARD_TILES entries
    {head_dim_bucket: (block_rows, block_cols, warps, min_blocks[, qk_unroll])}."""
    return _table_override(_TC_FORWARD_TILES, tiles_by_bucket)


# ---- backward -----------------------------------------------------------------------------

_TAG_WITH_FLOAT = dict(_TYPE_TAG, float32="float")
STATS_ROW_MULTIPLE = 128  # lse2 / D rows are padded to this; every query tile divides it


@dataclasses.dataclass(frozen=True)
class BackwardPreprocess(_Launch):
    """D = rowsum(dO * O) and lse2 per query row (``flash_bwd_preprocess``)."""

    dtype: str
    warps: int = 8  # one row per warp

    source = "flash_bwd.cu"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        return 0

    @property
    def name_expression(self) -> str:
        return f"cuflash::flash_bwd_preprocess<{_TAG_WITH_FLOAT[self.dtype]}, {self.warps}>"

    @property
    def key(self) -> str:
        return f"bwd_pre_{self.dtype}_w{self.warps}"


@dataclasses.dataclass(frozen=True)
class TensorCoreBackward(_Launch):
    """dK, dV (and atomic dQ) for float16/bfloat16 (``flash_bwd_kernel``), one CTA per key tile."""

    dtype: str
    head_dim: int
    head_dim_v: int
    block_rows: int  # BR: queries per tile walked
    block_cols: int  # BC: keys per CTA, 16 per warp
    warps: int
    min_blocks: int
    causal: bool
    do_dk: bool
    do_dv: bool
    atomic_dq: bool

    source = "flash_bwd.cu"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        k_pitch, v_pitch = self.head_dim + SMEM_PAD, self.head_dim_v + SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        elems = bc * k_pitch + bc * v_pitch + 2 * br * k_pitch + 2 * br * v_pitch + bc * (br + SMEM_PAD)
        return 4 * 2 * 2 * br + 2 * elems

    @property
    def name_expression(self) -> str:
        flags = ", ".join("true" if f else "false" for f in (self.causal, self.do_dk, self.do_dv, self.atomic_dq))
        return (
            f"cuflash::flash_bwd_kernel<{_TYPE_TAG[self.dtype]}, {self.head_dim}, {self.head_dim_v}, "
            f"{self.block_rows}, {self.block_cols}, {self.warps}, {self.min_blocks}, {flags}>"
        )

    @property
    def key(self) -> str:
        parts = [n for n, f in (("dk", self.do_dk), ("dv", self.do_dv), ("atomic_dq", self.atomic_dq)) if f]
        return (
            f"bwd_{self.dtype}_hd{self.head_dim}_br{self.block_rows}_bc{self.block_cols}_w{self.warps}"
            f"_{'_'.join(parts)}_causal_{str(self.causal).lower()}"
        )


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

    source = "flash_bwd.cu"

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        k_pitch, v_pitch = self.head_dim + SMEM_PAD, self.head_dim_v + SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        return 2 * (br * k_pitch + br * v_pitch + 2 * bc * k_pitch + 2 * bc * v_pitch)

    @property
    def name_expression(self) -> str:
        return (
            f"cuflash::flash_bwd_dq_kernel<{_TYPE_TAG[self.dtype]}, {self.head_dim}, {self.head_dim_v}, "
            f"{self.block_rows}, {self.block_cols}, {self.warps}, {self.min_blocks}, "
            f"{'true' if self.causal else 'false'}>"
        )

    @property
    def key(self) -> str:
        return (
            f"bwd_dq_{self.dtype}_hd{self.head_dim}_br{self.block_rows}_bc{self.block_cols}"
            f"_w{self.warps}_causal_{str(self.causal).lower()}"
        )


@dataclasses.dataclass(frozen=True)
class Float32BackwardDkDv(_Launch):
    """Exact-fp32 dK, dV (``flash_bwd_dkdv_f32_kernel``)."""

    dim_tiles: int  # DT = DVT = ceil(max(d, dv) / 32)
    causal: bool
    warps: int = 4
    keys_per_warp: int = 4

    source = "flash_bwd_f32.cu"
    dtype = "float32"

    @property
    def block_cols(self) -> int:
        return self.warps * self.keys_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        bk, pitch = self.block_cols, 32 * self.dim_tiles + 1
        return 4 * (bk * d + bk * dv + 2 * 32 * pitch)

    @property
    def name_expression(self) -> str:
        return (
            f"cuflash::flash_bwd_dkdv_f32_kernel<{self.dim_tiles}, {self.dim_tiles}, {self.warps}, "
            f"{self.keys_per_warp}, {'true' if self.causal else 'false'}>"
        )

    @property
    def key(self) -> str:
        return f"bwd_dkdv_float32_dt{self.dim_tiles}_causal_{str(self.causal).lower()}"


@dataclasses.dataclass(frozen=True)
class Float32BackwardDq(_Launch):
    """Exact-fp32 dQ (``flash_bwd_dq_f32_kernel``)."""

    dim_tiles: int
    causal: bool
    warps: int = 4
    rows_per_warp: int = 8

    source = "flash_bwd_f32.cu"
    dtype = "float32"

    @property
    def block_rows(self) -> int:
        return self.warps * self.rows_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        br = self.block_rows
        return 4 * (br * d + br * dv + 32 * (32 * self.dim_tiles + 1) + 32 * (dv + 1))

    @property
    def name_expression(self) -> str:
        return (
            f"cuflash::flash_bwd_dq_f32_kernel<{self.dim_tiles}, {self.warps}, {self.rows_per_warp}, "
            f"{'true' if self.causal else 'false'}>"
        )

    @property
    def key(self) -> str:
        return f"bwd_dq_float32_dt{self.dim_tiles}_causal_{str(self.causal).lower()}"


# (query rows per tile, keys per CTA, warps, min_blocks) of flash_bwd_kernel per bucket.
# Every warp keeps 16 rows of dK and dV (head_dim / 8 * 4 fp32 registers each); above 128
# the two are computed in separate passes.
_TC_BACKWARD_TILES = {
    32: (64, 128, 8, 1),
    64: (64, 128, 8, 1),
    96: (32, 128, 8, 1),  # 64-query tiles spill 40-112 bytes at 96 and 128
    128: (32, 128, 8, 1),
    160: (32, 128, 8, 1),
    192: (32, 128, 8, 1),
    224: (16, 128, 8, 1),
    256: (16, 128, 8, 1),
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


class BackwardPlan(typing.NamedTuple):
    preprocess: BackwardPreprocess
    key_passes: tuple  # kernels launched over key tiles
    dq: object  # a kernel launched over query tiles, or None when dQ is accumulated atomically
    atomic_dq: bool


def backward_plan(dtype: str, d: int, dv: int, causal: bool, deterministic: bool) -> BackwardPlan:
    causal = bool(causal)
    pre = BackwardPreprocess(dtype)
    if dtype == "float32":
        dim_tiles = -(-max(d, dv) // 32)
        keys_per_warp = 4 if dim_tiles <= 4 else 2
        rows_per_warp = 8 if dim_tiles <= 2 else 4 if dim_tiles <= 4 else 2
        return BackwardPlan(
            pre,
            (Float32BackwardDkDv(dim_tiles, causal, keys_per_warp=keys_per_warp),),
            Float32BackwardDq(dim_tiles, causal, rows_per_warp=rows_per_warp),
            False,
        )
    hd = head_dim_bucket(max(d, dv))
    atomic = not deterministic
    br, bc, warps, mb = _TC_BACKWARD_TILES[hd]

    def key_pass(do_dk, do_dv, atomic_dq):
        return TensorCoreBackward(dtype, hd, hd, br, bc, warps, mb, causal, do_dk, do_dv, atomic_dq)

    if hd <= SPLIT_BACKWARD_ABOVE:
        passes = (key_pass(True, True, atomic),)
    else:
        passes = (key_pass(False, True, atomic), key_pass(True, False, False))
    dq = None if atomic else TensorCoreBackwardDq(dtype, hd, hd, *_TC_BACKWARD_DQ_TILES[hd], causal)
    return BackwardPlan(pre, passes, dq, atomic)


def backward_tiles_override(tiles_by_bucket):
    """Temporarily replace _TC_BACKWARD_TILES entries (tuning runs, like forward_tiles_override)."""
    return _table_override(_TC_BACKWARD_TILES, tiles_by_bucket)


def all_backward_variants():
    variants = {}
    for causal in (False, True):
        for dtype in SUPPORTED_DTYPES:
            for dim in (HEAD_DIM_BUCKETS if dtype != "float32" else range(32, MAX_HEAD_DIM + 1, 32)):
                for deterministic in (False, True):
                    plan = backward_plan(dtype, dim, dim, causal, deterministic)
                    for kernel in (plan.preprocess, *plan.key_passes, plan.dq):
                        if kernel is not None:
                            variants[kernel.key] = kernel
    return list(variants.values())


def all_variants():
    """Every kernel variant the dispatcher can launch, forward and backward."""
    return all_forward_variants() + all_backward_variants()
