"""The kernel variants: one frozen dataclass per CUDA kernel template, what a launch of it is.

Each class names its source file, its kernel template and that template's traits struct, and
builds from its fields both the variant's key (``fwd_sm90_bf16_d128_bc128_s3_overlap_tma_persistent_causal``,
the cache and report name) and its name expression (the template instance NVRTC compiles):
``cuflash::flash_fwd_kernel<cuflash::FwdTraits</*dtype*/ cuflash::bf16, /*head_dim*/ 128, ...>>``,
one traits argument for each field, in the fields' order and under their names (the traits
struct in kernels/ declares its parameters with the same names: tests/test_variants.py holds
the two lists together).

Shared memory is sized here, once: a kernel whose layout is fixed by its fields gets its size
as the traits' last argument, ``smem_bytes``, which its layout struct (``FwdSmemLayout`` in
kernels/flash_fwd.cu, ...) static_asserts it comes to, and it traps if a launch gives it less;
the float32 kernels' rows are d and dv wide, so their size follows the call (``smem_bytes(d,
dv)``) and the kernel checks it at run time. Python is the source because it must size every
launch on a machine without a GPU, and a compiled kernel cannot hand a number back to the host
without a device read. The numbers every variant is built with (cuflash/_constants.py, and the
Hopper kernels' fixed CTA shapes below) reach the kernels as defines from :func:`kernel_defines`.

Which variant runs for which arguments is chosen in cuflash/_config.py, from the tile tables in
cuflash/_tiles.py; nothing here chooses.
"""

from __future__ import annotations

import dataclasses
import struct
import typing

from . import _constants, _params, _tma

# The C++ type of each dtype in a name expression.
_CPP_TYPE = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16", "float32": "float"}


def _cpp_value(value) -> str:
    """A traits argument as C++ spells it: a dtype as its C++ type, a bool as true / false, a
    number as it is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return _CPP_TYPE[value] if isinstance(value, str) else str(value)


# Words and prefixes of variant keys: the dtype's short name, and a short prefix for each
# numeric field (a true bool field reads as its name, a false one is left out).
_DTYPE_WORD = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_KEY_PREFIX = {"head_dim": "d", "head_dim_v": "dv", "block_rows": "br", "block_cols": "bc", "warps": "w",
               "min_blocks": "mb", "qk_unroll": "u", "stages": "s", "value_tiles": "dvt", "rows_per_warp": "rpw",
               "dim_tiles": "dt", "keys_per_warp": "kpw", "warps_s_rows": "ws", "warps_kv_rows": "wkv",
               "warps_dq_rows": "wdq", "row_warps": "rw"}


class _Launch:
    """What every kernel variant shares: a CTA of ``warps`` warps, a key and a name expression
    built from its fields, and its shared memory."""

    warps: int
    key_prefix: str  # what kind of kernel: fwd, fwd_sm90, bwd_dq, ...
    source: str  # its file in kernels/
    kernel: str  # its kernel template there, which takes one traits struct ...
    traits: str  # ... this one: a parameter for each field, then smem_bytes where the size is fixed
    # The dynamic shared memory of a kernel whose layout its fields fix (bytes), else None:
    # overridden by a property where there is one.
    fixed_smem = None

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, d: int = 0, dv: int = 0) -> int:
        """The dynamic shared memory of a launch at head dims d and dv (bytes)."""
        return self.fixed_smem or 0

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

    def traits_arguments(self) -> list:
        """[(name, value)] of the traits struct's parameters: the fields, then smem_bytes."""
        arguments = [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]
        if self.fixed_smem is not None:
            arguments.append(("smem_bytes", self.fixed_smem))
        return arguments

    @property
    def name_expression(self) -> str:
        arguments = ", ".join(f"/*{name}*/ {_cpp_value(value)}" for name, value in self.traits_arguments())
        return f"cuflash::{self.kernel}<cuflash::{self.traits}<{arguments}>>"


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
    kernel, traits = "flash_fwd_kernel", "FwdTraits"
    key_prefix = "fwd"

    # The block-sparse 256 x 32 forms at head dim 128 sat at the default budget (48 bytes on
    # sm_90a, 20 on sm_80, ba96d6a); the sequence geometry the varlen forms share took them to
    # 52 and 32. On Hopper they run only with the wgmma forward switched off (sparse head dim
    # 128 dispatches HopperForward), so they get 16 bytes of room rather than a new tile shape.
    @property
    def spill_allowance(self) -> int:
        return 64 if self.sparse and self.head_dim == 128 else 0

    @property
    def fixed_smem(self) -> int:  # FwdSmemLayout: Q (O is staged there too), two stages of K and V
        q_pitch = max(self.head_dim, self.head_dim_v) + _constants.SMEM_PAD
        k_pitch = self.head_dim + _constants.SMEM_PAD
        v_pitch = self.head_dim_v + _constants.SMEM_PAD
        elems = self.block_rows * q_pitch + 2 * self.block_cols * (k_pitch + v_pitch)
        return 2 * elems


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
    kernel, traits = "flash_fwd_f32_kernel", "Fwd32Traits"
    key_prefix = "fwd"
    dtype = "float32"
    block_cols = 32  # one key per lane

    @property
    def block_rows(self) -> int:
        return self.warps * self.rows_per_warp

    def smem_bytes(self, d: int, dv: int = 0) -> int:
        elems = self.block_rows * d + self.block_cols * (d + 1) + self.block_cols * 32 * self.value_tiles
        return 4 * elems


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
    varlen: bool = False  # a packed variable-length batch (persistent: items of any sequence and head)

    source = "flash_fwd_sm90.cu"
    kernel, traits = "flash_fwd_sm90_kernel", "Fwd90Traits"
    key_prefix = "fwd_sm90"
    block_rows = 128  # both, like HopperBackward's, reach the kernel through kernel_defines()
    warps = 12
    # The producer warpgroup runs with 40 registers a thread (at 24 its copy loop spilled 120
    # bytes). Only the block-sparse causal forms at head dim 128 spill (4 bytes).

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    @property
    def fixed_smem(self) -> int:
        tiles = 2 * self.head_dim * (self.block_rows + 2 * self.stages * self.block_cols)
        barriers = 8 * (2 + 4 * self.stages)
        return tiles + barriers + 1024  # Sm90SmemLayout: 1024 of slack to align the tiles


# ---- backward -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardPreprocess(_Launch):
    """D = rowsum(dO * O) and lse2 per query row (``flash_bwd_preprocess``)."""

    dtype: str
    warps: int = 8  # one row per warp
    varlen: bool = False

    source = "flash_bwd.cu"
    kernel, traits = "flash_bwd_preprocess", "BwdPreTraits"
    key_prefix = "bwd_pre"

    def rows_a_cta(self, dv: int) -> int:
        """Rows a CTA takes at once: 16-bit rows are read by ``width`` lanes in 16-byte vectors
        (preprocess_width in flash_bwd.cu), so a warp takes 32 / width of them. The kernel
        walks its rows in steps of the grid: this sizes the grid, correctness does not rest on it."""
        if self.dtype == "float32":  # one warp a row
            return self.warps
        width = 1
        while width < 32 and width * 8 < dv:
            width *= 2
        return self.warps * (32 // width)


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
    sparse: bool = False
    varlen: bool = False

    source = "flash_bwd.cu"
    kernel, traits = "flash_bwd_kernel", "BwdTraits"
    key_prefix = "bwd"

    @property
    def fixed_smem(self) -> int:  # BwdSmemLayout
        k_pitch, v_pitch = self.head_dim + _constants.SMEM_PAD, self.head_dim_v + _constants.SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        s_pitch = bc + _constants.SMEM_PAD
        elems = bc * k_pitch + bc * v_pitch + 2 * br * k_pitch + 2 * br * v_pitch + 2 * br * s_pitch
        return 4 * 3 * 2 * br + 2 * elems  # (m, log2 l) and D per query row, two stages


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
    kernel, traits = "flash_bwd_dq_kernel", "BwdDqTraits"
    key_prefix = "bwd_dq"

    @property
    def fixed_smem(self) -> int:  # BwdDqSmemLayout
        k_pitch, v_pitch = self.head_dim + _constants.SMEM_PAD, self.head_dim_v + _constants.SMEM_PAD
        br, bc = self.block_rows, self.block_cols
        return 2 * (br * k_pitch + br * v_pitch + 2 * bc * k_pitch + 2 * bc * v_pitch)


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
    kernel, traits = "flash_bwd_dkdv_f32_kernel", "BwdDkDv32Traits"
    key_prefix = "bwd_dkdv"
    dtype = "float32"
    block_rows = 32  # queries per tile walked: one per lane

    @property
    def block_cols(self) -> int:
        return self.warps * self.keys_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        bk, pitch = self.block_cols, 32 * self.dim_tiles + 1
        return 4 * (bk * d + bk * dv + 2 * 32 * pitch)


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
    kernel, traits = "flash_bwd_dq_f32_kernel", "BwdDq32Traits"
    key_prefix = "bwd_dq"
    dtype = "float32"
    block_cols = 32  # keys per tile walked: one per lane

    @property
    def block_rows(self) -> int:
        return self.warps * self.rows_per_warp

    def smem_bytes(self, d: int, dv: int) -> int:
        br = self.block_rows
        return 4 * (br * d + br * dv + 32 * (32 * self.dim_tiles + 1) + 32 * (dv + 1))


@dataclasses.dataclass(frozen=True)
class HopperBackward(_Launch):
    """The key-tile pass of the backward on wgmma, sm_90a only (kernels/flash_bwd_sm90.cu);
    the default for 16-bit d = dv in {64, 128} there (CUFLASH_WGMMA_BWD=0 or
    wgmma_backward(False) for the mma.sync pass). One CTA per 128 keys (``persistent``: one CTA an
    SM walking every 128 keys of every slice) walks query tiles of 64;
    a producer warpgroup and two consumer warpgroups of 64 keys. With deterministic dQ the
    mma.sync dQ kernel follows it. ``tma``: one producer thread loads through tensor maps
    (2-4% faster than the warpgroup's cp.async at every shape measured, fb4e54b; bench/NOTES.md,
    Backward on Hopper)."""

    dtype: str
    head_dim: int  # d = dv = head_dim exactly (64 or 128)
    atomic_dq: bool
    causal: bool
    stages: int = 2
    sparse: bool = False
    varlen: bool = False
    grouped: bool = False  # a CTA walks BwdParams.head_group query heads of a k/v head (GQA)
    tma: bool = False  # bulk copies (tensor maps: cuflash/_tma.py), else cp.async
    persistent: bool = False  # one CTA an SM walks (key tile, slice) items, loading the next K, V early

    source = "flash_bwd_sm90.cu"
    kernel, traits = "flash_bwd_sm90_kernel", "Bwd90Traits"
    key_prefix = "bwd_sm90"
    block_rows = 64
    block_cols = 128
    warps = 12
    # Spills, all within the common budget since the warp-uniform warpgroup index (3b2aee6):
    # float16 at 128 24 bytes in the block-sparse forms, 20-36 in the grouped ones (up to 64
    # before), with TMA none but causal grouped (16); at 64 with TMA the grouped forms 4 (36
    # causal), in the producer's 40 registers, which hold the dQ warp's loop there (kDqWarp,
    # flash_bwd_sm90.cu), and the persistent forms 20 there (each item's slice geometry);
    # otherwise none at 64 or in bfloat16. The block-sparse ones at head dim 128
    # with atomic dQ spilled 132-204 while the partial tiles' block look-ups sat inside the P^T
    # loop; they are a mask built before it now (partial_tile_keep, mask.cuh).

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    @property
    def fixed_smem(self) -> int:  # Bwd90SmemLayout
        hd, br, bc = self.head_dim, self.block_rows, self.block_cols
        kv_buffers = 2 if self.persistent else 1  # persistent: the next item's K, V load early
        tiles = 2 * (2 * kv_buffers * bc * hd + 2 * self.stages * br * hd + 2 * bc * br)  # K, V; Q, dO a stage; dS^T twice
        dq_tile = 4 * br * hd  # fp32, atomic dQ's tile before its bulk reduction
        barriers = 1 + 2 * self.stages + (3 if self.persistent else 0)
        return tiles + self.stages * 3 * br * 4 + dq_tile + 8 * barriers + 1024


class BackwardPlan(typing.NamedTuple):
    preprocess: BackwardPreprocess
    key_passes: tuple  # kernels launched over key tiles
    dq: object  # a kernel launched over query tiles, or None when dQ is accumulated atomically
    atomic_dq: bool


@dataclasses.dataclass(frozen=True)
class GradientReduce(_Launch):
    """The backward's last step for float32 accumulators (kernels/grad_reduce.cu): sums the
    slices of grouped heads (1 for dQ) and stores the gradient in the input dtype."""

    dtype: str
    warps: int = 8

    source = "grad_reduce.cu"
    kernel, traits = "grad_reduce_kernel", "GradReduceTraits"
    key_prefix = "grad_reduce"
    elements_per_thread = 4  # one float4 a step


# ---- decoding: split-KV with grouped heads packed (kernels/flash_decode.cu) -----------------------


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
    kernel, traits = "flash_decode_kernel", "DecodeTraits"
    key_prefix = "decode"

    @property
    def block_rows(self) -> int:
        return _constants.DECODE_ROW_TILE * self.row_warps

    @property
    def fixed_smem(self) -> int:
        """DecodeSmemLayout::bytes: Q, K and V stages (16-bit, unpadded swizzled rows), the page
        slots (paged: kPageSlots tiles of two pointers a key group, the first rows of K and V;
        dense: the stages plus one of 4 bytes a group, unused), and a row's bytes of slack for
        aligning the start."""
        row_bytes = 2 * self.head_dim
        tiles = row_bytes * (self.block_rows + 2 * self.stages * self.block_cols)
        groups = self.block_cols // _constants.DECODE_PAGE_GROUP
        slots = 16 * _constants.DECODE_PAGE_SLOTS * groups if self.paged else 4 * (self.stages + 1) * groups
        return tiles + slots + row_bytes


@dataclasses.dataclass(frozen=True)
class DecodeCombine(_Launch):
    """The merge of the splits' partial results (``flash_decode_combine_kernel``): one CTA a row,
    its warps taking the splits in turn (cuflash/_config.py: decode_combine_config)."""

    dtype: str
    warps: int = 4

    source = "flash_decode.cu"
    kernel, traits = "flash_decode_combine_kernel", "DecodeCombineTraits"
    key_prefix = "decode_combine"


def kernel_defines() -> dict:
    """{macro: value} of the numbers every variant is built with: those of cuflash/_constants.py,
    the Hopper kernels' fixed CTA shapes, and the parameter blocks as cuflash/_params.py lays
    them out (their sizes, and the words a call writes), read by kernels/common.cuh,
    tile_io.cuh, sm90.cuh, slice.cuh, flash_fwd_sm90.cu, flash_bwd_sm90.cu, flash_decode.cu and
    grad_reduce.cu (each a static_assert or a constant there); passed by _loader.base_options()."""
    return {
        "CUFLASH_SMEM_PAD": _constants.SMEM_PAD,
        "CUFLASH_MAX_LEAD": _constants.MAX_LEAD_DIMS,
        "CUFLASH_PARTIAL_TILE": _constants.PARTIAL_TILE,
        "CUFLASH_STATS_ROW_MULTIPLE": _constants.STATS_ROW_MULTIPLE,
        "CUFLASH_SLICE_GROUP": _constants.SLICE_GROUP,
        "CUFLASH_TILE_MAJOR_FORWARD_TILES": _constants.TILE_MAJOR_FORWARD_TILES,
        "CUFLASH_TILE_MAJOR_BACKWARD_TILES": _constants.TILE_MAJOR_BACKWARD_TILES,
        "CUFLASH_TILE_MAJOR_VARLEN_BACKWARD_TILES": _constants.TILE_MAJOR_VARLEN_BACKWARD_TILES,
        "CUFLASH_DECODE_ROWS": _constants.DECODE_ROW_TILE,
        "CUFLASH_DECODE_PAGE_GROUP": _constants.DECODE_PAGE_GROUP,
        "CUFLASH_DECODE_PAGE_BATCH": _constants.DECODE_PAGE_BATCH,
        "CUFLASH_DECODE_PAGE_SLOTS": _constants.DECODE_PAGE_SLOTS,
        "CUFLASH_MAX_DECODE_SPLITS": _constants.MAX_DECODE_SPLITS,
        "CUFLASH_FWD_PARAM_BYTES": struct.calcsize(_params.FWD_PARAM_FORMAT),
        "CUFLASH_FWD_POINTER_WORDS": _params.pointer_words(_params.FWD_PARAM_FORMAT),
        "CUFLASH_FWD_PARAM_WORDS": _params.member_words(_params.FWD_PARAM_FIELDS),
        "CUFLASH_CU_SEQLENS_WORD": _params.CU_SEQLENS_WORD,
        "CUFLASH_BWD_PARAM_BYTES": struct.calcsize(_params.BWD_PARAM_FORMAT),
        "CUFLASH_BWD_POINTER_WORDS": _params.pointer_words(_params.BWD_PARAM_FORMAT),
        "CUFLASH_BWD_PARAM_WORDS": _params.member_words(_params.BWD_PARAM_FIELDS),
        "CUFLASH_REDUCE_PARAM_BYTES": struct.calcsize(_params.REDUCE_PARAM_FORMAT),
        "CUFLASH_REDUCE_POINTER_WORDS": _params.pointer_words(_params.REDUCE_PARAM_FORMAT),
        "CUFLASH_REDUCE_PARAM_WORDS": _params.member_words(_params.REDUCE_PARAM_FIELDS),
        "CUFLASH_DECODE_PARAM_BYTES": struct.calcsize(_params.fields_format(_params.DECODE_PARAM_FIELDS)),
        "CUFLASH_DECODE_PARAM_WORDS": _params.member_words(_params.DECODE_PARAM_FIELDS),
        "CUFLASH_COMBINE_PARAM_BYTES": struct.calcsize(_params.fields_format(_params.COMBINE_PARAM_FIELDS)),
        "CUFLASH_COMBINE_PARAM_WORDS": _params.member_words(_params.COMBINE_PARAM_FIELDS),
        "CUFLASH_SM90_FWD_ROWS": HopperForward.block_rows,
        "CUFLASH_SM90_FWD_WARPS": HopperForward.warps,
        "CUFLASH_SM90_BWD_ROWS": HopperBackward.block_rows,
        "CUFLASH_SM90_BWD_KEYS": HopperBackward.block_cols,
        "CUFLASH_SM90_BWD_WARPS": HopperBackward.warps,
        "CUFLASH_SM90_MAPS_BYTES": _tma.PARAM_BYTES,
        "CUFLASH_SM90_BWD_MAPS_BYTES": _tma.BWD_PARAM_BYTES,
    }
