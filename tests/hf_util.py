"""Helpers for the transformers tests: tiny models from configs (no downloads), and a float64
stand-in for cuflash.torch.attention that keeps to its contract (dense and variable-length)."""

import torch

VOCAB = 128


def tiny_config(kind: str, **overrides):
    """A 2-layer, hidden-64, 4-head model with 2 k/v heads (GQA), head dim 16.

    kind: "llama" (causal, full attention) or "qwen2" (layer 0 full attention, layer 1 a sliding
    window of 5 keys: both mask types in one model).
    """
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        assert config.layer_types == ["full_attention", "sliding_attention"], config.layer_types
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def model_pair(config, name: str, dtype=torch.float64, device="cpu", seed=0):
    """The same weights under attn_implementation=name and "sdpa"."""
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # Each model its own config: from_config writes the implementation into the config object.
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name, dtype=dtype).to(device)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype).to(device)
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def _allowed(nq, nk, causal, window, device):
    """(nq, nk) bool: key j allowed for query i, causal and window bottom-right aligned."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    return allowed


def _dense64(q, k, v, causal, scale, window):
    """Attention in float64 on (..., H, N, d) with Hk dividing Hq; rows with no key give 0."""
    hq, hk = q.shape[-3], k.shape[-3]
    assert hq % hk == 0, (q.shape, k.shape)
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if nq == 0 or nk == 0:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    k = k.repeat_interleave(hq // hk, dim=-3)
    v = v.repeat_interleave(hq // hk, dim=-3)
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    allowed = _allowed(nq, nk, causal, window, q.device)
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m) * allowed
    l = p.sum(-1, keepdim=True)
    return (p @ v) / torch.where(l > 0, l, torch.ones_like(l))


class ReferenceAttention:
    """cuflash.torch.attention's contract in float64, recording each call's keyword arguments.

    Dense: q (B, Hq, Nq, d), k/v (B, Hk, Nk, d), causal bottom-right. Variable length: q
    (Hq, total_q, d), k/v (Hk, total_k, d) with any strides and a contiguous last dim, int32
    cu_seqlens on q's device that start at 0 and end at the totals, host-int max_seqlen at least
    every sequence's length; out (Hq, total_q, dv) contiguous. It asserts all of that.
    """

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, causal=False, scale=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None):
        self.calls.append(dict(causal=causal, scale=scale, window=window, varlen=cu_seqlens_q is not None,
                               shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
        assert q.dtype == k.dtype == v.dtype
        for t in (q, k, v):
            assert t.stride(-1) == 1 or t.shape[-1] == 1, t.stride()
        if cu_seqlens_q is None:
            assert cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None
            assert q.ndim == 4 and k.ndim == 4 and v.ndim == 4
            return _dense64(q, k, v, causal, scale, window).to(q.dtype)
        assert q.ndim == k.ndim == v.ndim == 3
        assert k.shape[:2] == v.shape[:2]
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.ndim == 1 and cu.device == q.device, (cu.dtype, cu.shape, cu.device)
        assert cu_seqlens_q.shape == cu_seqlens_k.shape
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cu_q[0] == 0 == cu_k[0] and cu_q[-1] == q.shape[1] and cu_k[-1] == k.shape[1], (cu_q, cu_k)
        pieces = []
        for (a, b), (c, d) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
            assert 0 <= b - a <= max_seqlen_q and 0 <= d - c <= max_seqlen_k, (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
            pieces.append(_dense64(q[:, a:b], k[:, c:d], v[:, c:d], causal, scale, window))
        return torch.cat(pieces, dim=1).to(q.dtype).contiguous()
