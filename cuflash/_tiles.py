"""The tile tables: per head dim (and architecture), the tile shapes each kernel runs with,
with the measurements and register counts that chose them.

Tile sizes follow the paper's line 1 (blocks sized to the on-chip memory) refined by the
register budget of the mma.sync layout: each warp owns 16 query rows and keeps its slice of O
(16 x head_dim fp32) and of S (16 x block_cols fp32) in registers. Wide heads therefore get
fewer rows per CTA and narrower key tiles.

These are data only: cuflash/_config.py reads them to choose a variant (and its
``forward_tiles_override`` replaces forward entries for tuning runs);
the variants they fill in are the dataclasses of cuflash/_variants.py.
"""

# Head dims are rounded up to one of these buckets; padded columns are zero-filled on load.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)


# ---- forward ------------------------------------------------------------------------------

# (block_rows, block_cols, warps, min_blocks) per head-dim bucket for the 16-bit forward.
# A warp holds (block_rows / warps / 16) row tiles; per thread O costs head_dim / 8 * 4 fp32
# registers per row tile and S block_cols / 8 * 4, which is what bounds these choices.
TC_FORWARD_TILES = {
    32: (128, 64, 4, 1, 4),
    64: (128, 64, 4, 1, 4),  # 322 TFLOP/s at seq 4096 on the H200 (bench/NOTES.md, Forward (mma.sync))
    96: (128, 64, 8, 1),
    128: (256, 32, 8, 1, 4),  # 293 TFLOP/s; (128, 32, 4, 1) is faster causal but spills
    160: (128, 32, 8, 1),
    192: (128, 32, 8, 1),
    224: (64, 16, 4, 1),  # 32-key tiles spill at 224 and 256: O alone is 112-128 registers
    256: (64, 16, 4, 1),
}


# (block_cols, stages, overlap, pingpong, persistent) of the wgmma forward per head dim. Its
# consumers hold S (64 x block_cols fp32, exponentiated in place), P (16-bit, the tile in P V)
# and O (64 x head_dim fp32) in the 240 registers a thread they take from the producer. Every
# form loads through TMA; the launch falls back to cp.async where the copy engine cannot map
# the inputs, and to one item a CTA where the persistent grid's 32-bit item count would not do.
# Overlap (S of t + 1 issued before P V of t, softmax of t + 1 while P V of t runs) with
# ping-pong is the fastest at hdim 64 (331 against 324 TFLOP/s at seq 4096, 435 against 408 at
# 16k). At hdim 128 neither helped (506 against 507 at 4096, 591 against 564 at 16k) until the
# warp-uniform warpgroup index (sm90.cuh): since, overlap alone is 1.7-3.1% faster at seq
# >= 2048 (level to 1.5% slower causal at 1024), with ping-pong on top no better and ping-pong
# alone level; bench/NOTES.md, Forward on Hopper (wgmma, TMA, persistence).
#
# persistent: True, False, or an int n: the persistent form (one CTA per SM walking the work
# items) runs when a head has at most n query tiles of 128 rows. It wins at seq 512-1024, where
# a CTA's ring fills and drains in a handful of key tiles; from 4096 the one-item-a-CTA grid
# was as fast or faster (causal: 447 against 528 TFLOP/s at hdim 128, seq 16k: its fixed
# round-robin of items, longest query tiles first, balances worse than the hardware handing a
# free SM the next CTA; but the non-causal forms, whose items are equal, lost too, so balance
# is not all of it: bench/NOTES.md, Forward on Hopper (wgmma, TMA, persistence)).
#
# Head dim 256: 64-key tiles and 2 stages (Q and a stage of K and V are 128 KB of shared
# memory; O is 128 of a consumer thread's 232 registers), with ping-pong: 456 against 417
# TFLOP/s at seq 4096, 567 against 520 at 16k (overlap on top: 454 and 554), 8cbec78. Never
# persistent: at seq 1024 that was 292 against 313 (13d71f8), and its forms spill 120-188 bytes.
#
# Packed (varlen) batches take the persistent form where a dense batch of their longest sequence
# would. At 64 it won as it does dense (64 x 12 x 1024, causal: 492 -> 435 us); at 128 it lost
# at first (64 x 32/8 x 1024: 1790 -> 1830 us) and wins since the hd128 forward took the
# warp-uniform warpgroup index (64 x 32/8 x 1024 2-4%, 64 x 32/8 x 512 9%: bench/NOTES.md,
# Packed batches (varlen)).
SM90_FORWARD_TILES = {64: (128, 3, True, True, 8), 128: (128, 3, True, False, 8), 256: (64, 2, False, True, False)}

# A block-sparse forward whose query tiles visit at most this many key tiles on average runs
# the persistent form at any length, per head dim: few key tiles an item leave a one-item CTA
# mostly filling and draining its ring, which the persistent form overlaps with the next item.
# Measured on the H200 (bench/NOTES.md, Block-sparse; bf16, 128 x 128 blocks, persistent against
# one item a CTA): hd64 2 x 32 x 8192 butterfly (7 tiles) 8.6% faster, local (5) 11.8%, random
# (7.5) 0.8%; 16384 butterfly (8) 8.2%, local 13.5%; from 14 tiles level to 2% slower (random,
# fixed, strided), dense 4-7% slower. hd128 (1 x 16 x 4096 / 16384) was level or slower on
# every pattern (1-16%), so it has no entry.
SM90_SPARSE_PERSISTENT_ROW_TILES = {64: 8}


# ---- backward -----------------------------------------------------------------------------

# Head dims at which the wgmma key pass (kernels/flash_bwd_sm90.cu) runs persistent when not
# causal: one CTA an SM walks the (key tile, slice) items, and its producer loads the next
# item's K and V into a second buffer while the consumers finish this one, where one item a CTA
# starts each CTA on an empty ring. Measured on the H200 (bench/NOTES.md, Backward on Hopper
# (key pass); bf16, one item a CTA -> persistent, two rounds each, us): 16 x 32 x 1024 x 64
# 1134-1140 -> 1072-1076 (5.6% faster), 4 x 32 x 4096 3520-3543 -> 3494-3508 (0.7%),
# 1 x 32 x 16384 13294-13387 -> 13273-13276 (0.5%). Causal it lost 6-14% (4 x 32 x 4096 1955-1983 -> 2242, 1 x 32 x 16384
# 6738-6867 -> 7240): a fixed round-robin of items of unequal length, which one item a CTA
# leaves to the hardware. At head dim 128 a second K and V (64 KB) does not fit beside the ring.
SM90_PERSISTENT_BACKWARD_DIMS = (64,)

# (query rows per tile, keys per CTA, warps, min_blocks, warps along S's queries, along dK/dV's
# keys, along dQ's queries) of flash_bwd_kernel per bucket. Per thread, dK and dV cost
# block_cols * head_dim / (32 * warps) fp32 registers each; above 128 the two are computed in
# separate passes, so only one of them is live.
TC_BACKWARD_TILES = {
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
TC_BACKWARD_TILES_PRE_HOPPER = {
    128: (64, 64, 8, 1, 2, 4, 2),
    192: (32, 64, 8, 1, 2, 4, 2),
}
# (query rows per CTA, keys per tile, warps, min_blocks) of the deterministic dQ kernel.
TC_BACKWARD_DQ_TILES = {
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


# ---- decoding: split-KV with grouped heads packed (kernels/flash_decode.cu) -----------------------
#
# A few queries a head against a long cache: the keys of each (batch, k/v head) are split over
# CTAs so that every SM streams K and V, and the query heads sharing a k/v head are packed into
# one tile of 16, 32 or 64 rows. The kernel is bound by device memory, not by the tensor
# cores: what a tile size buys is bytes in flight. Per CTA, STAGES - 1 tiles of BC keys (K and
# V, 2 * BC * hd * 2 bytes each) are in flight while one is computed.

# Head dims (any multiple of 8 up to 128) are padded (zero-filled) up to one of these. 256 is
# not offered: with O (16 x 256 fp32 a warp) at 128 registers a thread, the 64-key tile
# spilled 144-180 bytes (sm_80 and sm_90a, two stages); it needs O's columns split over warps.
DECODE_HEAD_DIM_BUCKETS = (64, 128)

# (block_cols, warps, stages) per (head-dim bucket, row warps). Three stages, so two tiles are
# in flight a CTA while one is computed. A stage of K and V is 32 KB at head dim 128 (64 keys,
# four warps): 103 KB a CTA lets two CTAs share an H100/H200 SM (228 KB, 1 KB of it reserved
# a CTA) and one an A100's. Four row warps hold 64 rows of Q, and their one key warp the whole
# tile's S: smaller tiles there (64 and 48 keys: 16 and 24 KB a stage) keep two CTAs an SM and
# S at 32 or 24 registers. One row warp at head dim 64 takes eight warps of 16 keys each (128
# keys, 101 KB, two CTAs an SM). Measured on the H200 (bench/NOTES.md, Decoding; GQA 32/8,
# one query, batch 1-128, 1k-128k keys): of 9 forms at head dim 128 and 8 at 64 (16-256 keys,
# 1-8 warps, 2-8 stages), these stream fastest; none passed ~4.2 TB/s at large batches then,
# which was the padded shared-memory rows (swizzled since: GQA reaches SDPA's ~4.4).
# Two row warps at head dim 64 (MQA) take eight warps (CUDA-graph GPU time, MQA
# 32/1: 128 x 8192 75.1 -> 66.4 us, 8 x 32768 29.4 -> 26.4, 128 x 1024 12.9 -> 11.7 against four);
# at head dim 128 eight warps of 128 keys (205 KB, one CTA an SM) gained 5% at 128 x 8192 but
# lost 17% at 1 x 131072 (29.0 -> 34.1 us), so four stay.
DECODE_TILES = {
    (64, 1): (128, 8, 3), (64, 2): (128, 8, 3), (64, 4): (64, 4, 3),
    (128, 1): (64, 4, 3), (128, 2): (64, 4, 3), (128, 4): (48, 4, 3),
}

# Short caches in grids several CTAs an SM deep (_config.decode_config's rule): one row warp at
# head dim 64 takes 64-key tiles of four warps (50 KB and half the registers a CTA, so four
# CTAs an SM, each with less of a start and an end to wait out). Measured on the H200
# (bench/NOTES.md, Decoding; CUDA-graph GPU us, GQA 32/8, one query): 128 x 1024 67.9 ->
# 65.6 (SDPA 64.6), 256 x 512 71.9 -> 67.0 (SDPA 66.1), 128 x 2048 124.6 -> 123.5 (SDPA 122.0);
# four stages 3-8% slower. At head dim 128 (32 keys, two warps; 64 keys, two stages) and for
# MQA's two row warps (64 keys, four or eight warps) none was faster.
DECODE_TILES_SHORT = {(64, 1): (64, 4, 3)}
DECODE_MAX_TILE_KEYS = max(cols for cols, _, _ in (*DECODE_TILES.values(), *DECODE_TILES_SHORT.values()))

# 16-row tiles a CTA the decoding kernel is built for (decode_row_warps in _config picks one).
DECODE_ROW_WARPS = (1, 2, 4)
