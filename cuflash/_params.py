"""The parameter blocks: how Python packs each struct a kernel takes.

Every member is 8 bytes: pointers ``Q``, integers ``q``, doubles ``d`` (struct.pack formats).
The kernels check each block against these layouts when they are built: ``_variants.
kernel_defines()`` passes the blocks' sizes, the words a call writes and (for the decoding
blocks) each member's word as defines, and kernels/common.cuh, grad_reduce.cu and
flash_decode.cu static_assert them, so a member renamed, moved, added or dropped on one side
stops the build. The plans (_launch.py, _forward.py, _backward.py, _decode.py) pack the
blocks; this module imports nothing but the standard library and cuflash/_constants.py, so the
defines need neither of them. Read each name through this module at the time of use
(``_params.FWD_PARAM_FORMAT``).
"""

from __future__ import annotations

import struct

from ._constants import MAX_LEAD_DIMS

# Field order of struct FwdParams in kernels/common.cuh (every member 8 bytes; the six pointers
# first, so a call rewrites words 0-5).
FWD_PARAM_FORMAT = "<" + "".join((
    "Q" * 6,                    # q, k, v, o, l, m
    "q" * 4 + "q",              # nq, nk, d, dv; num_batch
    "q" * (4 * MAX_LEAD_DIMS),  # lead_shape, q/k/v_lead_stride
    "q" * 3 + "q",              # q/k/v_row_stride; kv_group
    "dd",                       # scale, scale_log2
    "qq",                       # window_left, window_right
    "QQQ",                      # tile_counts, tile_lists, blocks
    "qq" + "q" * 4,             # n_outer, list_stride; block_q, block_k, mask_tq, mask_tk
    "q" * MAX_LEAD_DIMS,        # mask_lead_stride
    "QQqq",                     # cu_seqlens_q, cu_seqlens_k; num_seqs, varlen_tiles
))
# The word of cu_seqlens_q (cu_seqlens_k follows): a varlen call writes its two pointers there.
CU_SEQLENS_WORD = struct.calcsize(FWD_PARAM_FORMAT[:-4]) // 8
# struct BwdParams: the nine pointers first (words 0-8).
BWD_PARAM_FORMAT = "<" + "Q" * 9 + "q" + "q" * (2 * MAX_LEAD_DIMS) + "qq" + "qq" + "q"
# struct GradReduceParams in kernels/grad_reduce.cu: src, dst, groups, inner, outer.
REDUCE_PARAM_FORMAT = "<QQqqq"
# struct DecodeParams in kernels/flash_decode.cu, member by member (each 8 bytes); the kernel
# static_asserts each member's word as _variants.kernel_defines() passes it from here.
DECODE_PARAM_FIELDS = (
    ("q", "Q"), ("k", "Q"), ("v", "Q"), ("o", "Q"), ("l", "Q"), ("m", "Q"),
    ("ws_o", "Q"), ("ws_l", "Q"), ("ws_m", "Q"), ("page_table", "Q"), ("seqlens", "Q"),
    ("kv_heads", "q"), ("group", "q"), ("nq", "q"), ("rows", "q"), ("row_tiles", "q"), ("num_bh", "q"),
    ("capacity", "q"), ("d", "q"), ("dv", "q"),
    ("q_batch_stride", "q"), ("q_head_stride", "q"), ("q_row_stride", "q"),
    ("k_batch_stride", "q"), ("k_head_stride", "q"), ("k_row_stride", "q"),
    ("v_batch_stride", "q"), ("v_head_stride", "q"), ("v_row_stride", "q"),
    ("page_shift", "q"), ("max_pages", "q"), ("num_pages", "q"),
    ("num_splits", "q"), ("tiles_per_split", "q"),
    ("scale", "d"), ("scale_log2", "d"),
    ("window_left", "q"), ("window_right", "q"),
)
COMBINE_PARAM_FIELDS = (
    ("ws_o", "Q"), ("ws_l", "Q"), ("ws_m", "Q"), ("o", "Q"), ("l", "Q"), ("m", "Q"),
    ("total_rows", "q"), ("dv", "q"), ("num_splits", "q"), ("scale", "d"), ("scale_log2", "d"),
)


def fields_format(fields) -> str:
    """The struct.pack format of a block packed by name: ((name, kind), ...)."""
    return "<" + "".join(kind for _, kind in fields)


def pointer_words(param_format: str) -> int:
    """The pointers at the start of a struct.pack format ("<QQQqd..."): the words a call writes."""
    kinds = param_format.lstrip("<")
    return len(kinds) - len(kinds.lstrip("Q"))


def member_words(fields) -> str:
    """CUFLASH_PARAM_WORD(name, word) for each (name, kind) member of a block packed by name, one
    8-byte word each: flash_decode.cu expands it into a static_assert each."""
    return " ".join(f"CUFLASH_PARAM_WORD({name}, {word})" for word, (name, _) in enumerate(fields))
