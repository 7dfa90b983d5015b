"""The parameter blocks: how Python packs each struct a kernel takes.

Each block is listed member by member, in the struct's order, as (name, kind) or (name, kind,
count) for an array: every member is 8 bytes, pointers ``Q``, integers ``q``, doubles ``d``
(struct.pack formats). The kernels check each block against these lists when they are built:
``_variants.kernel_defines()`` passes each block's size, the words a call writes and every
member's word as defines, and kernels/common.cuh, grad_reduce.cu and flash_decode.cu
static_assert them, so a member renamed, moved, added or dropped on one side stops the build.
The plans (_launch.py, _forward.py, _backward.py, _decode.py) pack
the blocks; this module imports nothing but the standard library
and cuflash/_constants.py, so the defines need neither of them. Read each name through this
module at the time of use (``_params.FWD_PARAM_FORMAT``).
"""

from __future__ import annotations

import struct

from ._constants import MAX_LEAD_DIMS

# struct FwdParams in kernels/common.cuh: the six pointers first, so a call rewrites words 0-5.
FWD_PARAM_FIELDS = (
    ("q", "Q"), ("k", "Q"), ("v", "Q"), ("o", "Q"), ("l", "Q"), ("m", "Q"),
    ("nq", "q"), ("nk", "q"), ("d", "q"), ("dv", "q"), ("num_batch", "q"),
    ("lead_shape", "q", MAX_LEAD_DIMS), ("q_lead_stride", "q", MAX_LEAD_DIMS),
    ("k_lead_stride", "q", MAX_LEAD_DIMS), ("v_lead_stride", "q", MAX_LEAD_DIMS),
    ("q_row_stride", "q"), ("k_row_stride", "q"), ("v_row_stride", "q"), ("kv_group", "q"),
    ("scale", "d"), ("scale_log2", "d"),
    ("window_left", "q"), ("window_right", "q"),
    ("tile_counts", "Q"), ("tile_lists", "Q"), ("blocks", "Q"),
    ("n_outer", "q"), ("list_stride", "q"), ("block_q", "q"), ("block_k", "q"), ("mask_tq", "q"), ("mask_tk", "q"),
    ("mask_lead_stride", "q", MAX_LEAD_DIMS),
    ("cu_seqlens_q", "Q"), ("cu_seqlens_k", "Q"), ("num_seqs", "q"), ("varlen_tiles", "q"),
)
# struct BwdParams: the nine pointers first (words 0-8).
BWD_PARAM_FIELDS = (
    ("dout", "Q"), ("out", "Q"), ("l", "Q"), ("m", "Q"), ("lse2", "Q"), ("delta", "Q"),
    ("dq_acc", "Q"), ("dk_acc", "Q"), ("dv_acc", "Q"),
    ("nq_pad", "q"), ("do_lead_stride", "q", MAX_LEAD_DIMS), ("o_lead_stride", "q", MAX_LEAD_DIMS),
    ("do_row_stride", "q"), ("o_row_stride", "q"), ("dkv_in_dtype", "q"), ("zero_dq_acc", "q"), ("head_group", "q"),
)
# struct GradReduceParams in kernels/grad_reduce.cu.
REDUCE_PARAM_FIELDS = (("src", "Q"), ("dst", "Q"), ("groups", "q"), ("inner", "q"), ("outer", "q"))
# struct DecodeParams in kernels/flash_decode.cu.
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
# struct DecodeCombineParams in kernels/flash_decode.cu.
COMBINE_PARAM_FIELDS = (
    ("ws_o", "Q"), ("ws_l", "Q"), ("ws_m", "Q"), ("o", "Q"), ("l", "Q"), ("m", "Q"),
    ("total_rows", "q"), ("dv", "q"), ("num_splits", "q"), ("scale", "d"), ("scale_log2", "d"),
)


def fields_format(fields) -> str:
    """The struct.pack format of a block: ((name, kind[, count]), ...)."""
    return "<" + "".join(member[1] * _count(member) for member in fields)


def _count(member) -> int:
    """The 8-byte words of a member: its count, for an array."""
    return member[2] if len(member) > 2 else 1


def _member_offsets(fields):
    """(name, word) of each member of a block: its first 8-byte word."""
    word = 0
    for member in fields:
        yield member[0], word
        word += _count(member)


def member_word(fields, name: str) -> int:
    """The first word of member ``name`` of a block."""
    return dict(_member_offsets(fields))[name]


def pointer_words(param_format: str) -> int:
    """The pointers at the start of a struct.pack format ("<QQQqd..."): the words a call writes."""
    kinds = param_format.lstrip("<")
    return len(kinds) - len(kinds.lstrip("Q"))


def member_words(fields) -> str:
    """CUFLASH_PARAM_WORD(name, word) for each member of a block, its first 8-byte word: the
    kernels expand it into a static_assert each."""
    return " ".join(f"CUFLASH_PARAM_WORD({name}, {word})" for name, word in _member_offsets(fields))


# The blocks as struct.pack formats: what _plan.py packs the forward, backward and reduce with.
FWD_PARAM_FORMAT = fields_format(FWD_PARAM_FIELDS)
BWD_PARAM_FORMAT = fields_format(BWD_PARAM_FIELDS)
REDUCE_PARAM_FORMAT = fields_format(REDUCE_PARAM_FIELDS)
# The word of cu_seqlens_q (cu_seqlens_k follows): a varlen call writes its two pointers there.
CU_SEQLENS_WORD = member_word(FWD_PARAM_FIELDS, "cu_seqlens_q")
