"""What the plans' launches are made of: grids, the FwdParams block every forward and backward
kernel takes (with its block-sparsity fields), and the per-call check of 16-byte vector loads.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

from . import _checks, _constants, _driver, _params
from ._constants import MAX_LEAD_DIMS

# ---- grids -----------------------------------------------------------------------------------


def slice_grid(grid_x: int, num_batch: int):
    """A grid of grid_x tiles for every (batch..., head) slice: y holds up to 65535, z the rest."""
    grid_y = min(num_batch, 65535)
    if -(-num_batch // grid_y) > 65535:
        raise ValueError(f"{num_batch} (batch..., head) slices exceed the {65535 ** 2} a launch grid can hold")
    return grid_x, grid_y, -(-num_batch // grid_y)


def forward_grid(variant, tiles: int, slices: int, device_id: int):
    """The forward's grid: one CTA an SM walking the tiles x slices items (a persistent
    variant), else a CTA each (slice_grid)."""
    if getattr(variant, "persistent", False):
        return (min(tiles * slices, _driver.sm_count(device_id)), 1, 1)
    return slice_grid(tiles, slices)


def grid_tiles(longest: int, total: int, tile: int) -> int:
    """Tiles a slice's CTAs start on along ``total`` rows: those of the longest sequence the
    caller announces for a packed batch (all the rows of a dense slice), no more than the rows
    hold, at least one (a CTA of an empty sequence just exits)."""
    return max(1, -(-min(longest, total) // tile))


class Plan:
    """What every plan is (cuflash/_forward.py's, _backward.py's, _decode.py's): what a problem
    decided, its launches bound once on one device. ``run(pointers, stream)`` checks a call's
    raw pointers (the order ``pointer_names`` gives), writes them into the bound launches and
    launches them on ``stream``. The caller allocates the outputs, and ``workspace_bytes`` of
    device memory where a plan takes a pointer named 'workspace'."""

    pointer_names: tuple = ()
    workspace_bytes: int = 0
    device_id: int

    def run(self, pointers: tuple, stream: int):
        raise NotImplementedError

    def check_alignment(self, pointers):
        """The error a misaligned input gets (16-byte vector loads): ``pointers`` in the order
        of ``self.operands`` (name, shape, element strides), of dtype ``self.dtype``."""
        if self.dtype != "float32":
            for (name, shape, strides), ptr in zip(self.operands, pointers):
                if ptr & 15:
                    raise _checks.vector_alignment_error(name, shape, strides, ptr, self.dtype)


class Geometry(NamedTuple):
    """What a plan's builder derived from its problem, its checks done, for binding the kernels
    it chose (cuflash/_forward.py, _backward.py)."""

    problem: object
    nq: int  # query rows (a varlen batch's: all of a head's)
    nk: int
    d: int
    dv: int
    layout: object  # the launch's BatchLayout
    out_lead: tuple  # the output's leading dims
    scale: float
    mask: object  # a BlockMask or None
    window: object  # (left, right) or None
    slices: int  # the launch's (batch..., head) slices; a varlen batch's (sequence, head)
    longest_q: int  # the query rows a slice's grid covers
    longest_k: int  # the key rows
    heads: int = 0  # the backward's: the merged leading dims' slices (a varlen batch's heads)
    nq_pad: int = 0  # the backward's statistics' rows a head
    stats_rows: int = 0  # the rows the backward's preprocess covers a slice


# ---- parameter blocks ------------------------------------------------------------------------

# The block-sparsity fields of a dense launch: null lists, so the kernel walks every tile.
DENSE_TILES = (0,) * (3 + 2 + 4 + MAX_LEAD_DIMS)
DENSE_SPARSITY = _checks.NO_WINDOW + DENSE_TILES  # the fields from window_left to mask_lead_stride


def forward_params(nq, nk, d, dv, layout, row_strides, scale, sparsity=DENSE_SPARSITY, num_seqs=0,
                   varlen_tiles=0) -> bytes:
    """struct FwdParams with null pointers (a call writes them); sparsity: the fields from
    window_left on (sparsity_fields). num_seqs > 0: a varlen launch of that many sequences,
    nq and nk the packed totals; its slices are (sequence, head), and its cu_seqlens pointers
    are written per call (_params.CU_SEQLENS_WORD). varlen_tiles: a persistent varlen
    forward's query tiles a slice (the x of its one-item-a-CTA grid)."""
    num_batch = math.prod(layout.lead_shape) * (num_seqs or 1)
    values = (
        0, 0, 0, 0, 0, 0,
        nq, nk, d, dv, num_batch,
        *layout.lead_shape, *layout.q_strides, *layout.k_strides, *layout.v_strides,
        *row_strides, layout.kv_group, scale, scale * math.log2(math.e), *sparsity, 0, 0, num_seqs, varlen_tiles,
    )
    return struct.pack(_params.FWD_PARAM_FORMAT, *values)


def sparse_row_tiles(mask, nq, nk, block_rows, block_cols, *, causal, window) -> float:
    """The mean number of key tiles a query tile of block_rows x block_cols tiles visits under
    ``mask`` (from its host tile lists, which the mask keeps); nq > 0, as every plan that asks
    has at least one query tile."""
    counts = mask.tile_lists(nq, nk, block_rows, block_cols, causal=causal, window=window).counts
    return float(counts.mean())


def sparsity_fields(mask, mask_strides, nq, nk, variant, *, transpose, causal, window):
    """The FwdParams fields after scale_log2 for one launch of ``variant``, and the device
    arrays they point at (the plan holds them).

    transpose: the launch walks key tiles (the backward's key passes). Without a mask the
    lists are null (a dense launch, the window still applies).
    """
    if mask is None:
        return (*(window or _checks.NO_WINDOW), *DENSE_TILES), None
    tiles = mask.device_tile_lists(nq, nk, variant.block_rows, variant.block_cols, transpose=transpose,
                                   causal=causal, window=window)
    fields = (
        *(window or _checks.NO_WINDOW),
        tiles.counts.data.ptr, tiles.lists.data.ptr, tiles.blocks.data.ptr, tiles.n_outer, tiles.list_stride,
        *mask.block_size, *mask.shape[-2:], *mask_strides,
    )
    return fields, tiles


def check_vector_operands(operands, ptrs, dtype):
    """The 16-bit kernels load 16-byte vectors: every operand's pointer and strides must allow it."""
    if dtype == "float32":
        return
    for (name, shape, strides), ptr in zip(operands, ptrs):
        if ptr & 15 or not _checks.vector_stride_ok(shape, strides, _checks.itemsize(dtype)):
            raise _checks.vector_alignment_error(name, shape, strides, ptr, dtype)


# ---- packed variable-length batches (varlen) ----------------------------------------------
#
# q (Hq, total_q, d), k (Hk, total_k, d), v (Hk, total_k, dv): one leading dim, the heads, and
# num_seqs sequences whose rows cu_seqlens_q / cu_seqlens_k (device arrays, never read here)
# delimit. A launch's slices are (sequence, head): num_seqs * Hq of them, each owning one
# sequence of one head (kernels/slice.cuh). max_seqlen only sizes the grid's x axis; a longer
# sequence's CTAs walk its further tiles, so it is never a bound on correctness.


def varlen_stats_rows(total_q: int, num_seqs: int) -> int:
    """Rows of the backward's statistics per head: each sequence's padded to a multiple of
    STATS_ROW_MULTIPLE, at the offsets slice_geometry gives (which end by this)."""
    r = _constants.STATS_ROW_MULTIPLE
    return (-(-total_q // r) + num_seqs) * r
