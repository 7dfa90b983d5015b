"""Hugging Face transformers integration: cuflash as an ``attn_implementation``.

    import cuflash.transformers
    from transformers import AutoModelForCausalLM

    name = cuflash.transformers.register()                  # "cuattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

:func:`register` adds two functions under one name: :func:`attention_forward` to transformers'
``AttentionInterface`` (what every attention layer calls) and :func:`attention_mask` to its
``AttentionMaskInterface`` (what the model calls once per forward, per mask type, to describe
masking). The name holds no "flash": transformers sends any implementation whose name contains
"flash" to its hub-kernel loader.

What the mask function hands to the layers, chosen so that a layer does no mask work:

- ``None`` when every key a layer holds is a real token and the keys end where the queries
  end (training without padding, generation without padding): the layer calls cuflash's dense
  path, causal (bottom-right aligned) and windowed as the layer asks.
- A :class:`RaggedLayout` otherwise: right padding (training), left padding (batched
  generation with a KV cache, where the queries are the last ``q_length`` of the keys),
  padding-free packed rows (``position_ids`` restarting per sequence, as
  ``DataCollatorWithFlattening`` builds them) and static caches longer than what has been
  written. It holds ``cu_seqlens`` that cut the padded (batch, length) token grid into
  variable-length sequences: the real tokens of each row, and the padding as sequences of
  queries without keys (their output is 0, like flash-attn's unpadded path) or keys without
  queries. The layer runs cuflash's variable-length path on the padded tensors as they are,
  viewed token-major: nothing is gathered or scattered, and its output is exact.

The padding layout is built once per forward with one host synchronisation (it reads whether the
mask has padding at all, whether each row's real tokens form one run, and the longest segment);
a packed layout reads its sequence starts once per forward, on the first layer that needs it,
and not at all when the batch carries ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)``), which the layers then use directly. Sliding windows and GQA
(k/v with fewer heads, passed unrepeated) work on every path.

Refused with an error naming the feature: attention dropout, ``output_attentions``, logit
softcapping, attention sinks (``s_aux``), position biases, sparse-attention indices, custom
``or_mask_function`` / ``and_mask_function`` / bidirectional-block masks, 4-D masks, and
padding masks whose real tokens do not form one run per row.

Importing this module imports transformers; ``import cuflash`` does not.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils.import_utils import is_tracing

from . import torch as _cuflash_torch

__all__ = ["NAME", "register", "attention_forward", "attention_mask", "RaggedLayout", "window_of"]

NAME = "cuattn"

# Substrings transformers gives a meaning of its own when it validates attn_implementation:
# "flash" sends the name to the hub-kernel loader, "sdpa" and "flex_attention" to their
# availability checks, "paged|" to the paged-cache wrappers, "/" and ":" make it a hub repo id.
_RESERVED_PARTS = ("flash", "sdpa", "flex_attention", "paged|", "/", ":")

# Keyword arguments of features cuflash does not compute: a call that sets one is refused.
_UNSUPPORTED_FEATURES = {
    "softcap": "logit softcapping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "sparse-attention key indices",
    "block_indices": "block-sparse key indices",
}


def register(name: str = NAME) -> str:
    """Register cuflash's attention and mask functions with transformers under ``name``.

    Returns ``name``, to pass as ``attn_implementation``. Registering again (any number of
    times, under any number of names) is harmless.

    >>> name = cuflash.transformers.register()     # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=name)  # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    reserved = [part for part in _RESERVED_PARTS if part in name]
    if reserved or name == "eager":
        raise ValueError(
            f"name {name!r} cannot be used: transformers treats names containing {reserved or ['eager']} "
            f"specially when it checks attn_implementation; pick another, e.g. {NAME!r}"
        )
    attention_functions = transformers.AttentionInterface()
    if name in attention_functions and attention_functions[name] is not attention_forward:
        raise ValueError(f"name {name!r} is already registered with transformers for another attention function")
    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# ---- windows ---------------------------------------------------------------------------------


def window_of(sliding_window: Optional[int], causal: bool) -> Optional[Tuple[int, int]]:
    """cuflash's ``window=(left, right)`` for transformers' ``sliding_window``.

    transformers (masking_utils) lets query i see key j under a sliding window when
    ``j > i - sliding_window`` (with causal ``j <= i``): the query and the ``sliding_window - 1``
    keys before it, so ``(sliding_window - 1, 0)``. Its bidirectional window lets
    ``|i - j| <= sliding_window``: ``(sliding_window, sliding_window)``. Both are aligned at the
    diagonal that cuflash's bottom-right alignment puts there (the queries are the last keys).
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


# ---- the layout of padded and packed batches -------------------------------------------------


class RaggedLayout:
    """Variable-length sequences cut out of a padded (batch, length) token grid.

    Token (b, n) of the queries is flat token ``b * q_length + n``, and likewise for the keys
    with ``kv_length``. ``cu_seqlens_q`` and ``cu_seqlens_k`` (int32, on the device) give each
    sequence's start in those flat orders; sequence s of the queries attends only to sequence s
    of the keys, causal aligned at its bottom right. ``max_seqlen_q`` and ``max_seqlen_k`` are
    host ints at least as large as any sequence (upper bounds are allowed).

    The layout of a packed batch is read from the device on first use (:meth:`segments`) and
    kept, so one forward reads it once however many layers use it.

    ``shape`` and ``ndim`` say (batch, 1, q_length, kv_length) like the 4-D masks transformers
    passes through unchanged: generate() builds the mask of a static cache before the forward,
    and the forward hands it on as prepared.
    """

    ndim = 4

    def __init__(self, batch_size: int, q_length: int, kv_length: int, build):
        self.batch_size, self.q_length, self.kv_length = batch_size, q_length, kv_length
        self._build = build

    @functools.cached_property
    def _segments(self):
        return self._build()

    @property
    def shape(self):
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def segments(self):
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
        return self._segments

    def __repr__(self):
        return (f"RaggedLayout(batch_size={self.batch_size}, q_length={self.q_length}, "
                f"kv_length={self.kv_length})")


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 (S + 1,) starts of consecutive sequences of the given lengths (any shape, row-major)."""
    flat = lengths.reshape(-1).to(torch.int32)
    return torch.nn.functional.pad(torch.cumsum(flat, 0, dtype=torch.int32), (1, 0))


def _padding_layout(key_mask: torch.Tensor, q_length: int, kv_length: int, q_offset, kv_offset: int,
                    read_back: bool) -> Optional[RaggedLayout]:
    """The layout of a batch whose real keys are marked in ``key_mask`` (batch, kv_length), or
    None when there is no padding and the keys end where the queries end.

    The keys are absolute positions ``kv_offset + j``, the queries ``q_offset + i``; the queries'
    positions lie among the keys' (transformers' caches hold the current tokens). Each row's
    real keys must form one run [A, A + R). Per row five sequences, in token order:
    (queries of the left padding | no keys), (no queries | keys of the left padding),
    (real queries | real keys), (queries of the right padding | no keys), (no queries | keys of
    the right padding). The real queries are the real keys inside the query range; real keys
    after the last query are never visible under causal masking and go with the right padding,
    so the real queries are the last of the real keys and bottom-right alignment is exact.
    """
    batch = key_mask.shape[0]
    device = key_mask.device
    positions = torch.arange(kv_length, device=device)
    run_length = key_mask.sum(-1)
    run_start = torch.where(run_length > 0, key_mask.to(torch.uint8).argmax(-1), 0)
    queries_end = q_offset + q_length  # an int, or a device scalar (static caches)
    run_end_abs = torch.minimum(kv_offset + run_start + run_length,
                                torch.as_tensor(queries_end, device=device))
    keys_real = torch.clamp(run_end_abs - (kv_offset + run_start), min=0)
    first_q = torch.clamp(kv_offset + run_start - q_offset, 0, q_length)
    end_q = torch.clamp(run_end_abs - q_offset, 0, q_length)
    queries_real = torch.clamp(end_q - first_q, min=0)
    zeros = torch.zeros_like(run_length)
    q_lengths = torch.stack([first_q, zeros, queries_real, q_length - first_q - queries_real, zeros], -1)
    k_lengths = torch.stack([zeros, run_start, keys_real, zeros, kv_length - run_start - keys_real], -1)
    cu_q, cu_k = _cu_seqlens(q_lengths), _cu_seqlens(k_lengths)
    max_q, max_k = q_length, kv_length
    if read_back:
        one_run = (positions >= run_start[:, None]) & (positions < (run_start + run_length)[:, None])
        no_padding = key_mask.all()
        keys_end_at_queries = torch.as_tensor(queries_end == kv_offset + kv_length, device=device)
        flags = torch.stack([no_padding & keys_end_at_queries, (one_run == key_mask).all(),
                             q_lengths.max(), k_lengths.max()]).tolist()  # the one host sync
        if flags[0]:
            return None
        if not flags[1]:
            rows = torch.nonzero((one_run != key_mask).any(-1)).flatten().tolist()
            raise ValueError(
                f"attention_mask: cuflash takes padding masks whose real tokens form one run per row "
                f"(left or right padding); rows {rows[:8]} of the (batch, {key_mask.shape[1]}) key mask "
                f"have padding between real tokens"
            )
        max_q, max_k = max(int(flags[2]), 1), max(int(flags[3]), 1)
    segments = (cu_q, cu_k, max_q, max_k)
    return RaggedLayout(batch, q_length, kv_length, lambda: segments)


def _packed_layout(mask_function, batch: int, length: int, device) -> RaggedLayout:
    """The layout of packed rows, read from transformers' mask function: a new sequence starts
    at token t where the mask keeps t from seeing t - 1. Read on first use (one host sync)."""

    def build():
        b = torch.arange(batch, device=device)[:, None]
        head = torch.zeros((), dtype=torch.long, device=device)
        t = torch.arange(1, length, device=device)[None, :]
        sees_previous = torch.as_tensor(mask_function(b, head, t, t - 1), device=device).expand(batch, length - 1)
        sees_next = torch.as_tensor(mask_function(b, head, t - 1, t), device=device).expand(batch, length - 1)
        starts = torch.ones(batch, length, dtype=torch.bool, device=device)
        starts[:, 1:] = ~sees_previous
        bounds = torch.nonzero(starts.reshape(-1)).flatten()
        total = torch.full((1,), batch * length, dtype=bounds.dtype, device=device)
        cu = torch.cat([bounds, total]).to(torch.int32)
        host = torch.cat([cu.to(torch.long), sees_next.any().to(torch.long)[None]]).tolist()  # the one sync
        if host[-1]:
            raise NotImplementedError(
                "attention_mask: this model's mask lets a token see a later one (bidirectional blocks, "
                "e.g. block_sequence_ids); cuflash's packed path is causal per sequence")
        cu_host = host[:-1]
        longest = max(b - a for a, b in zip(cu_host[:-1], cu_host[1:]))
        return cu, cu, longest, longest

    return RaggedLayout(batch, length, length, build)


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                   allow_is_causal_skip: bool = True, use_vmap: bool = False, device="cpu", **kwargs):
    """transformers' mask function for cuflash (``AttentionMaskInterface``): ``None`` or a
    :class:`RaggedLayout`, as the module docstring says.

    Arguments as transformers passes them (masking_utils.create_causal_mask and friends):
    ``attention_mask`` is the 2-D padding mask (batch, seen + q_length), True or 1 for real
    tokens; the keys are positions ``kv_offset + j``, j < kv_length, the queries
    ``q_offset + i``, i < q_length.
    """
    if use_vmap:  # transformers asks for vmap exactly when or/and mask functions were given
        raise NotImplementedError(
            "attention_mask: cuflash does not take custom mask functions (or_mask_function / "
            "and_mask_function); it computes causal, sliding-window, padding and packed-sequence masks")
    if isinstance(attention_mask, RaggedLayout):  # built before the forward (generate, static caches)
        return attention_mask
    bidirectional = "allow_is_bidirectional_skip" in kwargs  # passed by create_bidirectional_mask only
    static_offsets = isinstance(q_offset, int) and isinstance(kv_offset, int)
    if attention_mask is None:
        keys_end_at_queries = static_offsets and q_offset + q_length == kv_offset + kv_length
        if (not allow_is_causal_skip and not bidirectional and static_offsets and q_offset == 0 == kv_offset
                and q_length == kv_length > 1):
            # Plain causal rows would have allowed the skip; with no padding mask and no cache
            # (offsets 0) what transformers adds is the packed-sequence mask of position_ids.
            return _packed_layout(mask_function, batch_size, q_length, device)
        if keys_end_at_queries:
            return None
        # Keys past the queries (a static cache not yet written to its end): padding.
        key_positions = kv_offset + torch.arange(kv_length, device=device)
        key_mask = (key_positions < q_offset + q_length)[None, :].expand(batch_size, kv_length)
    else:
        if attention_mask.ndim != 2:
            raise ValueError(f"attention_mask: cuflash takes a 2-D padding mask (batch, length), "
                             f"got shape {tuple(attention_mask.shape)}")
        key_mask = attention_mask.to(device=device, dtype=torch.bool)
        if key_mask.shape[-1] < kv_offset + kv_length:  # a static cache longer than the mask
            key_mask = torch.nn.functional.pad(key_mask, (0, kv_offset + kv_length - key_mask.shape[-1]))
        key_mask = key_mask[:, kv_offset:kv_offset + kv_length]
    return _padding_layout(key_mask, q_length, kv_length, q_offset, kv_offset,
                           read_back=not is_tracing(key_mask))


# ---- the attention function ------------------------------------------------------------------


def _check_features(dropout, kwargs):
    if dropout:
        raise ValueError(f"dropout: cuflash has no attention dropout, got dropout={dropout} "
                         f"(set the config's attention_dropout to 0)")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: cuflash never forms the attention weights; "
                         "use attn_implementation='eager' to get them")
    for key, feature in _UNSUPPORTED_FEATURES.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(f"{key}: cuflash does not implement {feature} (this model passes {key}=...)")


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (H, B * N, d): a view when the model's layout is token-major ((B, N, H, d)
    memory, as q/k/v come out of the projections), else one copy into that layout."""
    b, h, n, d = x.shape
    return x.transpose(0, 1).reshape(h, b * n, d)


def _packed_kwargs(kwargs, device):
    """cu_seq_lens_q/k and max_length_q/k given with the batch, as the varlen path takes them."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(name) for name in names]
    if any(v is None for v in values):
        missing = [name for name, v in zip(names, values) if v is None]
        raise ValueError(f"{', '.join(missing)}: packed batches need all of {', '.join(names)}")
    cu = []
    for name, value in zip(names[:2], values[:2]):
        if value.ndim != 1 or value.device != device or value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 (or int64) tensor on {device}, got shape "
                             f"{tuple(value.shape)}, dtype {value.dtype} on {value.device}")
        cu.append(value if value.dtype == torch.int32 else value.to(torch.int32))  # (S + 1,) ints: cheap
    # Python ints from DataCollatorWithFlattening; a tensor is read back here (a host sync).
    return cu[0], cu[1], int(values[2]), int(values[3])


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      dropout: float = 0.0, scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention function for cuflash (``AttentionInterface``).

    query (B, Hq, Nq, d), key and value (B, Hk, Nk, d / dv) with Hk dividing Hq (not repeated);
    ``attention_mask`` is what :func:`attention_mask` returned (or a 2-D padding mask whose keys
    are the layer's keys, the queries the last Nq of them). Returns ((B, Nq, Hq, dv), None).
    ``scaling`` is cuflash's ``scale``; causal is the layer's ``is_causal`` unless given.
    """
    _check_features(dropout, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = window_of(sliding_window, causal)
    batch, heads, q_length, _ = query.shape
    kv_length = key.shape[2]

    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        segments = _packed_kwargs(kwargs, query.device)
    elif attention_mask is None:
        out = _cuflash_torch.attention(query, key, value, causal=causal, scale=scaling, window=window)
        return out.transpose(1, 2), None
    else:
        if isinstance(attention_mask, torch.Tensor):
            if attention_mask.ndim != 2 or attention_mask.shape != (batch, kv_length):
                raise ValueError(
                    f"attention_mask: cuflash takes the mask its own mask function builds, or a 2-D padding "
                    f"mask (batch, kv_length) = ({batch}, {kv_length}); got shape {tuple(attention_mask.shape)} "
                    f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
            layout = _padding_layout(attention_mask.to(torch.bool), q_length, kv_length, kv_length - q_length, 0,
                                     read_back=not is_tracing(attention_mask))
            if layout is None:
                out = _cuflash_torch.attention(query, key, value, causal=causal, scale=scaling, window=window)
                return out.transpose(1, 2), None
        elif isinstance(attention_mask, RaggedLayout):
            layout = attention_mask
        else:
            raise ValueError(f"attention_mask: cuflash cannot use a {type(attention_mask).__name__} "
                             f"(register() sets the mask function that builds what it needs)")
        if (layout.batch_size, layout.q_length, layout.kv_length) != (batch, q_length, kv_length):
            raise ValueError(
                f"attention_mask: built for batch {layout.batch_size}, {layout.q_length} queries and "
                f"{layout.kv_length} keys, but this layer has query {tuple(query.shape)}, key {tuple(key.shape)}")
        if not causal and q_length != kv_length:
            raise ValueError(f"cuflash's padded non-causal attention needs as many queries as keys, got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}")
        segments = layout.segments()

    cu_q, cu_k, max_q, max_k = segments
    out = _cuflash_torch.attention(_token_major(query), _token_major(key), _token_major(value), causal=causal,
                                   scale=scaling, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=max_q, max_seqlen_k=max_k)
    # (Hq, B * Nq, dv) -> (B, Nq, Hq, dv), the layout transformers' attention functions return.
    return out.view(heads, batch, q_length, out.shape[-1]).permute(1, 2, 0, 3), None
