"""The fixed numbers: what a call may ask for, and what the kernels are built around.

Nothing here is chosen per shape (the tile tables are in cuflash/_tiles.py, the choices in
cuflash/_config.py). The numbers the kernels share reach them as -D defines from
``_variants.kernel_defines()``; Python reads each through this module's attribute at the time
of use (``_constants.SMEM_PAD``), so that the one value here is the one every side sees.
This module imports nothing: the argument checks, the broadcasting rule and the mask tile
lists take their limits from it without loading the variants.
"""

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")  # the dtypes of the mma.sync and wgmma kernels
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # one 16-byte vector of a 16-bit type

# Shared with the kernels through kernel_defines() (so they are written only here; changing one
# changes the compile options, and with them CuPy's disk-cache key).
SMEM_PAD = 8  # elements of padding per shared-memory row of the mma.sync kernels (kSmemPad)
MAX_LEAD_DIMS = 4  # leading (batch) dims a launch takes once those that can be merged are (kMaxLead)
PARTIAL_TILE = 1 << 30  # flag bit of a tile-list entry whose tile needs the element mask (kPartialTile)
# The backward's per-row statistics (lse2, D) are padded to a multiple of this many rows; the
# kernels check that their query tiles divide it (kStatsRowMultiple).
STATS_ROW_MULTIPLE = 128
# The Hopper kernels' causal grids of at most this many tiles a slice (forward query tiles of
# dense batches, backward key tiles of dense and of packed varlen ones) start their CTAs tile by
# tile in groups of SLICE_GROUP slices (kSliceGroup, kTileMajorForward, kTileMajorBackward,
# kTileMajorVarlenBackward in kernels/slice.cuh): long tiles first, a group's tiles together in
# L2. Where each was measured to win: bench/NOTES.md, Forward on Hopper, Backward on Hopper and
# Packed batches.
SLICE_GROUP = 16
TILE_MAJOR_FORWARD_TILES = 32
TILE_MAJOR_BACKWARD_TILES = 64
TILE_MAJOR_VARLEN_BACKWARD_TILES = 8

# Decoding (kernels/flash_decode.cu). The first four reach it through kernel_defines().
DECODE_ROW_TILE = 16  # packed query rows a warp (kDecodeRows, one m16 tile)
DECODE_PAGE_GROUP = 16  # keys a page-table look-up covers (kPageGroup): the smallest page size
DECODE_PAGE_BATCH = 4  # key tiles whose page-table entries are read together (kPageBatch)
DECODE_PAGE_SLOTS = 8  # key tiles whose group addresses a paged CTA holds (kPageSlots)
MAX_DECODE_QUERIES = 16  # queries a head the decoding kernels take (Nq)
DECODE_PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_DECODE_SPLITS = 256
