"""NumPy reference implementation of cuflash attention -- the executable spec.

Everything in this module is plain NumPy, computed in float64 unless stated
otherwise.  It is the oracle every test compares the CUDA kernels against, and
it is meant to be read: when this file and any other description of cuflash
disagree, this file is right.

Conventions
-----------
Shapes::

    q    (..., Nq, d)        queries
    k    (..., Nk, d)        keys
    v    (..., Nk, dv)       values
    o    (*batch, Nq, dv)    output
    l, m (*batch, Nq)        softmax statistics (row sum and row max)

Scores are ``S = scale * q @ k^T`` with ``scale = 1 / sqrt(d)`` by default.

Key ``j`` is *allowed* for query ``i`` when

* ``causal`` is off, or ``j <= i + (Nk - Nq)`` (the causal diagonal is aligned
  to the bottom-right corner, as in flash-attention >= 2.1, so the last query
  always sees every key), and
* the optional boolean ``mask`` (broadcastable to ``(*batch, Nq, Nk)``, True
  meaning allowed) is True at ``[..., i, j]``.

Over the allowed keys of row ``i``::

    m[i] = max_j S[i, j]
    l[i] = sum_j exp(S[i, j] - m[i])
    o[i] = sum_j exp(S[i, j] - m[i]) / l[i] * v[j]

A row with no allowed key has ``o = 0``, ``l = 0`` and ``m = -inf``; nothing
here ever produces NaN or a floating-point warning for such rows.
``m + log(l)`` is the row's log-sum-exp.

Leading dimensions (all but the last two) are batch dimensions and broadcast
by NumPy rules, with one extension for grouped-query attention: when q's last
leading dimension ``Hq`` and the (k, v) last leading dimension ``Hk`` satisfy
``Hk > 1``, ``Hk != Hq`` and ``Hq % Hk == 0``, query head ``h`` reads key/value
head ``h // (Hq // Hk)``.  ``Hk == 1`` is ordinary broadcasting.  k and v must
broadcast with each other.  :func:`broadcast_plan` and :func:`expand_kv` are
the single place where these rules are written down.

Functions
---------
* :func:`standard_attention` -- direct float64 attention (materialises S).
* :func:`flash_forward_tiled` -- FlashAttention Algorithm 1, block by block.
* :func:`standard_attention_backward` -- analytic gradients.
* :func:`flash_backward_tiled` -- FlashAttention backward (Algorithm 4),
  block by block with recomputation.
* :func:`block_sparse_forward_tiled` -- block-sparse FlashAttention
  (Algorithm 5): Algorithm 1 that skips the tiles a
  :class:`cuflash.masks.BlockMask` marks absent.
* :func:`block_sparse_backward_tiled` -- its backward: Algorithm 4 that
  skips the same tiles.
* :func:`element_mask` -- the element mask a block mask and a sliding window
  stand for; ``standard_attention(mask=element_mask(...))`` is the oracle of
  block-sparse and windowed attention.
* :func:`lowp_attention` -- plain attention evaluated the way a framework does
  it in float16 / bfloat16 / float32; its error against the float64 reference
  sets the error budget of the kernels.
* :func:`round_to` -- round values to float16 / bfloat16 / float32.
* :func:`varlen_attention`, :func:`varlen_attention_backward` -- packed
  variable-length batches (``cu_seqlens``), one sequence at a time on the
  functions above; :func:`sequence_rows` is the boundaries' clamping rule.

Where things are: :mod:`.dense` (standard attention, its backward, the shared front end),
:mod:`.broadcasting`, :mod:`.tiled` (Algorithms 1 and 4), :mod:`.block_sparse` (Algorithm 5,
:func:`element_mask`) and :mod:`.low_precision`.
"""

from .block_sparse import block_sparse_backward_tiled, block_sparse_forward_tiled, element_mask
from .broadcasting import BroadcastPlan, broadcast_plan, expand_kv
from .dense import ReferenceOutput, allowed_keys, standard_attention, standard_attention_backward
from .low_precision import lowp_attention, lowp_attention_backward, round_to
from .tiled import flash_backward_tiled, flash_forward_tiled
from .varlen import covered_rows, sequence_rows, varlen_attention, varlen_attention_backward

__all__ = [
    "ReferenceOutput",
    "BroadcastPlan",
    "broadcast_plan",
    "expand_kv",
    "allowed_keys",
    "standard_attention",
    "standard_attention_backward",
    "flash_forward_tiled",
    "flash_backward_tiled",
    "block_sparse_forward_tiled",
    "block_sparse_backward_tiled",
    "element_mask",
    "round_to",
    "lowp_attention",
    "lowp_attention_backward",
    "sequence_rows",
    "covered_rows",
    "varlen_attention",
    "varlen_attention_backward",
]
