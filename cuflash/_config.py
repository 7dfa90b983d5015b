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

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # one 16-byte vector of a 16-bit type
# Head dims are rounded up to one of these buckets; padded columns are zero-filled on load.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
SMEM_PAD = 8  # elements of padding per shared-memory row (kSmemPad in flash_fwd.cu)

_TYPE_TAG = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}


def head_dim_bucket(dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds {MAX_HEAD_DIM}")


@dataclasses.dataclass(frozen=True)
class TensorCoreForward:
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

    @property
    def threads(self) -> int:
        return 32 * self.warps

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
class Float32Forward:
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

    @property
    def threads(self) -> int:
        return 32 * self.warps

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
def forward_tiles_override(tiles_by_bucket):
    """Temporarily replace table entries {head_dim_bucket: (block_rows, block_cols, warps, min_blocks)}.

    For tuning runs (bench/tune_forward.py) that compare tile sizes in one process.
    """
    saved = dict(_TC_FORWARD_TILES)
    _TC_FORWARD_TILES.update(tiles_by_bucket)
    try:
        yield
    finally:
        _TC_FORWARD_TILES.clear()
        _TC_FORWARD_TILES.update(saved)
