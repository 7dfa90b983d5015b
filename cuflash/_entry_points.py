"""One entry point a mode: packed variable-length batches and decoding against a KV cache.

:func:`cuflash.attention` stays the dense and block-sparse call. The two functions here take
only the arguments of their mode (a keyword of another mode is a TypeError by signature) and
pass them on to :func:`cuflash.attention`, whose checks name the argument and quote the shapes
and dtypes given before anything is launched. The torch and JAX adapters define the same two
over their own ``attention``.
"""

from __future__ import annotations

from . import _api


def check_boundaries_given(entry: str, cu_seqlens_q, cu_seqlens_k):
    """Both boundary arrays of a packed batch are there. Passed on as None they would make
    ``attention`` take the dense path without a word, so ``entry`` refuses them itself."""
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if value is None:
            raise TypeError(f"{entry} needs {name}, an int32 array of length batch + 1 on the inputs' device, "
                            f"got None; a batch without boundaries is dense: call attention")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                     scale=None, window=None, out=None) -> _api.AttentionOutput:
    """Attention over a packed batch of sequences of different lengths (flash_attn_varlen_func).

    Args:
        q: (Hq, total_q, d), k: (Hk, total_k, d), v: (Hk, total_k, dv): the sequences
            concatenated along the token dim, heads first. flash-attn's (total, H, d) arrays
            pass as ``x.swapaxes(0, 1)``, a view (only the last dim must be contiguous).
            float16, bfloat16 or float32, one dtype; d and dv multiples of 8 up to 256; Hk
            divides Hq (query head h reads k/v head h // (Hq // Hk)). CuPy arrays or CUDA
            arrays exporting ``__dlpack__`` / ``__cuda_array_interface__``, taken without a copy.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b owns rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], ...) of k and v.
            The host never reads them: the kernels clamp each into [0, total] and take an end
            before its start as an empty sequence. With ``CUFLASH_VALIDATE=1`` in the
            environment the host checks them before each launch, forward and backward, and
            raises a ValueError naming the first boundary out of range or falling.
        max_seqlen_q, max_seqlen_k: host ints, the longest sequences; they size the grid only
            (a longer sequence is still computed whole). None computes them from the
            boundaries with one device-to-host copy.
        causal, window: as :func:`cuflash.attention`'s, aligned at each sequence's bottom right.
        scale: multiplies q k^T; default 1 / sqrt(d).
        out: (o, l, m) to write instead of new arrays, as :func:`cuflash.attention` takes it.

    Returns:
        AttentionOutput(o, l, m) of CuPy arrays: o (Hq, total_q, dv) in q's dtype, l and m
        (Hq, total_q) float32, per packed token as :func:`cuflash.attention` defines them.
        Rows that no sequence covers are left unwritten. Gradients:
        :func:`cuflash.attention_backward` with the same boundaries.

    Example:
        >>> cu = cupy.asarray([0, 17, 130, 131], cupy.int32)       # 3 sequences, 131 tokens
        >>> q = cupy.random.randn(131, 8, 64).astype(cupy.float16).swapaxes(0, 1)   # (8, 131, 64)
        >>> o, l, m = cuflash.attention_varlen(q, q, q, cu, cu, 113, 113, causal=True)
    """
    check_boundaries_given("attention_varlen", cu_seqlens_q, cu_seqlens_k)
    return _api.attention(q, k, v, causal=causal, scale=scale, window=window, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, out=out)


def attention_with_kvcache(q, k_cache, v_cache, *, page_table=None, seqlens_k=None, num_splits=None,
                           causal: bool = False, scale=None, window=None, out=None) -> _api.AttentionOutput:
    """Decoding: a few new queries a sequence against a dense or paged KV cache, split over the keys.

    Args:
        q: (batch..., Hq, Nq, d); the batch dims must address as one (a reshape to
            (B, Hq, Nq, d) would be a view). flash-attn's (B, Nq, Hq, d) passes as
            ``q.swapaxes(1, 2)``.
        k_cache, v_cache: dense (batch..., Hk, Nk, d) / (..., dv) with q's batch dims, or, with
            ``page_table``, paged (num_pages, Hk, page_size, d) / (..., dv), page_size a power
            of two in 16..256; vLLM's and FlashInfer's (num_pages, page_size, Hk, d) pass as
            ``.swapaxes(1, 2)`` without a copy. Hk divides Hq.
        page_table: int32 (batch, max_pages), C-contiguous, on q's device: key j of sequence b
            lies on page page_table[b, j // page_size]. A page index outside [0, num_pages) is
            never read: that page's keys are masked.
        seqlens_k: int32 (batch,) on q's device, each sequence's key count; required with
            ``page_table``, optional for a dense cache (default Nk). Read by the kernels only:
            a value is clamped into [0, capacity]. With ``CUFLASH_VALIDATE=1`` in the
            environment the host checks both before each launch and raises a ValueError
            naming the first length past the capacity or page index in use outside the pool.
        num_splits: the number of key splits of each (batch, k/v head), an int from 1 to
            ``cuflash._constants.MAX_DECODE_SPLITS``; None chooses it from the shapes and the
            GPU's SM count.
        causal, window: aligned at each sequence's end: query i of Nq sees key j iff
            j <= len - Nq + i (causal) and len - Nq + i - left <= j <= len - Nq + i + right.
        scale: multiplies q k^T; default 1 / sqrt(d).
        out: (o, l, m) to write instead of new arrays, as :func:`cuflash.attention` takes it.

    With any of ``page_table``, ``seqlens_k``, ``num_splits`` the call runs the split-KV
    decoding kernels: 1 to 16 queries a head, float16 or bfloat16, head dims up to 128 (an
    error says which rule a call breaks). Without them the cache is dense and whole, and the
    call is :func:`cuflash.attention`'s, which takes the same kernels for such short queries.

    Returns:
        AttentionOutput(o, l, m) of CuPy arrays: o (batch..., Hq, Nq, dv) in q's dtype, l and
        m (batch..., Hq, Nq) float32; a sequence of length 0 gives o = 0, l = 0, m = -inf.
        Partial results over disjoint caches combine with :func:`cuflash.merge`.

    Example (vLLM's cache layout, one new token a sequence):
        >>> k_cache = cupy.zeros((num_pages, 64, 8, 128), cupy.float16)   # (pages, page_size, Hk, d)
        >>> o, l, m = cuflash.attention_with_kvcache(q, k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2),
        ...                                          page_table=block_tables, seqlens_k=context_lens)
    """
    return _api.attention(q, k_cache, v_cache, causal=causal, scale=scale, window=window, page_table=page_table,
                          seqlens_k=seqlens_k, num_splits=num_splits, out=out)
