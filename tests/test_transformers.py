"""cuflash.transformers on CPU: tiny models built from configs run with cuflash.torch.attention
replaced by a float64 reference of its contract (tests/hf_util.py), against transformers' own
"sdpa" attention on the same weights in float64. Skips when transformers is not installed."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

transformers = pytest.importorskip("transformers")

import cuflash.torch  # noqa: E402
from cuflash import masks  # noqa: E402
from hf_util import VOCAB, ReferenceAttention, model_pair, tiny_config  # noqa: E402

ct = pytest.importorskip("cuflash.transformers")

TOL = dict(rtol=1e-9, atol=1e-10)  # float64 on both sides: only the summation order differs


@pytest.fixture
def reference(monkeypatch):
    """cuflash.torch.attention as the float64 reference; the registered name."""
    fake = ReferenceAttention()
    monkeypatch.setattr(cuflash.torch, "attention", fake)
    return fake, ct.register()


def _tokens(generator, *shape):
    return torch.randint(3, VOCAB, shape, generator=generator)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours, sdpa):
    a, b = _grads(ours), _grads(sdpa)
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m: f"{name}: {m}")


def _padding_mask(lengths, width, side):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, width - n:] = 1
    return mask


# ---- registration and the window conversion ---------------------------------------------------


def test_register_returns_its_name_and_is_idempotent():
    name = ct.register()
    assert name == ct.NAME == "cuattn" and "flash" not in name
    assert ct.register() == name
    assert transformers.AttentionInterface()[name] is ct.attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ct.attention_mask
    assert ct.register("cuattn_other") == "cuattn_other"


@pytest.mark.parametrize("name", ["cuflash", "my_flash", "sdpa_fast", "paged|x", "org/repo", "eager", ""])
def test_register_refuses_names_transformers_treats_specially(name):
    with pytest.raises(ValueError, match="name"):
        ct.register(name)


def test_register_refuses_a_name_taken_by_another_function():
    transformers.AttentionInterface.register("cuattn_taken", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        ct.register("cuattn_taken")


@pytest.mark.parametrize("sliding_window", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 9), (7, 7), (4, 17), (17, 17)])
def test_window_matches_transformers_sliding_masks(sliding_window, nq, nk):
    """window_of(...) with cuflash's bottom-right causal keeps exactly the keys that
    transformers' own sliding-window masks keep, for queries that are the last nq keys."""
    from transformers import masking_utils as mu

    theirs = mu.sdpa_mask(batch_size=1, q_length=nq, kv_length=nk, q_offset=nk - nq, allow_is_causal_skip=False,
                          mask_function=mu.sliding_window_causal_mask_function(sliding_window))[0, 0]
    left, right = ct.window_of(sliding_window, causal=True)
    causal = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    ours = torch.from_numpy(masks.sliding_window(nq, nk, left, right)) & causal
    assert torch.equal(ours, theirs)
    if nq == nk:
        theirs = mu.sdpa_mask(batch_size=1, q_length=nq, kv_length=nk, allow_is_causal_skip=False,
                              mask_function=mu.sliding_window_bidirectional_mask_function(sliding_window))[0, 0]
        assert torch.equal(torch.from_numpy(masks.sliding_window(nq, nk, *ct.window_of(sliding_window, False))),
                           theirs)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_window_of_refuses_non_positive_or_non_int(bad):
    with pytest.raises(ValueError, match="sliding_window"):
        ct.window_of(bad, causal=True)


# ---- training-shaped forwards: causal, padding, sliding window --------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_causal_logits_and_grads_match_sdpa(reference, kind):
    fake, name = reference
    ours, sdpa = model_pair(tiny_config(kind), name)
    x = _tokens(torch.Generator().manual_seed(1), 3, 23)  # longer than qwen2's window of 5
    losses = [m(x, labels=x).loss for m in (ours, sdpa)]
    torch.testing.assert_close(ours(x).logits, sdpa(x).logits, **TOL)
    for loss in losses:
        loss.backward()
    _assert_same_grads(ours, sdpa)
    assert fake.calls and not any(c["varlen"] for c in fake.calls)  # no mask work: the dense path
    assert all(c["causal"] and c["scale"] == 16 ** -0.5 for c in fake.calls)
    assert all(c["shapes"][1][1] == 2 for c in fake.calls)  # k passed with its 2 heads, not repeated
    windows = {c["window"] for c in fake.calls}
    assert windows == ({None} if kind == "llama" else {None, (4, 0)})


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_logits_and_grads_match_sdpa(reference, kind, side):
    fake, name = reference
    ours, sdpa = model_pair(tiny_config(kind), name)
    lengths, width = [17, 9, 1, 13], 17
    x = _tokens(torch.Generator().manual_seed(2), len(lengths), width)
    mask = _padding_mask(lengths, width, side)
    labels = x.masked_fill(mask == 0, -100)
    out = [m(x, attention_mask=mask, labels=labels) for m in (ours, sdpa)]
    keep = mask.bool()
    torch.testing.assert_close(out[0].logits[keep], out[1].logits[keep], **TOL)
    torch.testing.assert_close(out[0].loss, out[1].loss, **TOL)
    for o in out:
        o.loss.backward()
    _assert_same_grads(ours, sdpa)
    assert fake.calls and all(c["varlen"] for c in fake.calls)


def test_padded_layout_gives_zero_output_at_padded_queries(reference):
    _, name = reference
    module = torch.nn.Module()
    module.is_causal = True
    mask = _padding_mask([3, 5], 5, "left").bool()
    layout = ct.attention_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=mask, device="cpu")
    q, k, v = (torch.randn(2, h, 5, 8, dtype=torch.float64) for h in (4, 2, 2))
    out, weights = ct.attention_forward(module, q, k, v, layout)
    assert weights is None and out.shape == (2, 5, 4, 8)
    assert torch.all(out[0, :2] == 0) and torch.all(out[0, 2:] != 0) and torch.all(out[1] != 0)


# ---- generation with a KV cache ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_generate_matches_sdpa(reference, kind, cache):
    """Batched greedy generation from left-padded prompts: the queries are the last keys of a
    cache; qwen2's sliding layer's cache drops keys once it holds more than its window."""
    fake, name = reference
    ours, sdpa = model_pair(tiny_config(kind), name)
    lengths, width = [7, 3, 1], 7
    prompts = _tokens(torch.Generator().manual_seed(3), len(lengths), width)
    mask = _padding_mask(lengths, width, "left")
    prompts = prompts.masked_fill(mask == 0, 0)
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True,
                   pad_token_id=0, eos_token_id=None)
    if cache == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        a, b = (m.generate(prompts, attention_mask=mask, **options) for m in (ours, sdpa))
    assert torch.equal(a.sequences, b.sequences)
    for step_a, step_b in zip(a.logits, b.logits):
        torch.testing.assert_close(step_a, step_b, **TOL)
    assert any(c["varlen"] and c["shapes"][0][1] == len(lengths) for c in fake.calls)  # decode steps, padded


def test_unpadded_generate_uses_the_dense_path(reference):
    fake, name = reference
    ours, sdpa = model_pair(tiny_config("qwen2"), name)
    prompts = _tokens(torch.Generator().manual_seed(4), 2, 9)
    options = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True,
                   pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        a, b = (m.generate(prompts, attention_mask=torch.ones_like(prompts), **options) for m in (ours, sdpa))
    assert torch.equal(a.sequences, b.sequences)
    for step_a, step_b in zip(a.logits, b.logits):
        torch.testing.assert_close(step_a, step_b, **TOL)
    assert fake.calls and not any(c["varlen"] for c in fake.calls)


# ---- padding-free packed batches ------------------------------------------------------------------


def _packed_against_separate(reference, kind, flash_kwargs):
    fake, name = reference
    ours, sdpa = model_pair(tiny_config(kind), name)
    g = torch.Generator().manual_seed(5)
    sequences = [_tokens(g, n) for n in (7, 1, 13, 6)]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": s.tolist()} for s in sequences])
    assert (("cu_seq_lens_q" in batch) == flash_kwargs) and batch["input_ids"].shape == (1, 27)
    weights = torch.randn(1, 27, VOCAB, dtype=torch.float64, generator=g)
    # transformers reads packing from position_ids only in a forward without a cache (sdpa too).
    packed = ours(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    (packed * weights).sum().backward()
    varlen_calls = [c for c in fake.calls if c["varlen"]]
    # Against the same sequences run one by one through sdpa.
    start = 0
    separate = []
    for s in sequences:
        logits = sdpa(s[None]).logits
        (logits * weights[:, start:start + len(s)]).sum().backward()
        separate.append(logits)
        start += len(s)
    torch.testing.assert_close(packed, torch.cat(separate, dim=1), **TOL)
    _assert_same_grads(ours, sdpa)
    assert varlen_calls and all(c["cu_seqlens_q"].tolist() == [0, 7, 8, 21, 27] for c in varlen_calls
                                if c["window"] is None)
    return varlen_calls


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_position_ids_match_separate_sequences(reference, kind):
    calls = _packed_against_separate(reference, kind, flash_kwargs=False)
    assert all(c["max_seqlen_q"] == 13 for c in calls)  # read back once per mask: the exact longest


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_flash_kwargs_match_separate_sequences(reference, kind):
    calls = _packed_against_separate(reference, kind, flash_kwargs=True)
    assert all(c["cu_seqlens_q"].tolist() == [0, 7, 8, 21, 27] and c["max_seqlen_k"] == 13 for c in calls)


def test_packed_batch_through_sdpa_agrees_too(reference):
    """transformers' sdpa packs by position_ids as well: the two implementations agree on the
    packed batch itself, not only against separate sequences."""
    _, name = reference
    ours, sdpa = model_pair(tiny_config("llama"), name)
    g = torch.Generator().manual_seed(6)
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": _tokens(g, n).tolist()} for n in (5, 11, 1)])
    torch.testing.assert_close(ours(**batch, use_cache=False).logits, sdpa(**batch, use_cache=False).logits, **TOL)


# ---- refusals ------------------------------------------------------------------------------------


def _qkv():
    return (torch.randn(1, h, 4, 8, dtype=torch.float64) for h in (4, 2, 2))


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module


def test_dropout_is_refused(reference):
    _, name = reference
    ours, _ = model_pair(tiny_config("llama", attention_dropout=0.1), name)
    ours.train()
    with pytest.raises(ValueError, match="dropout"):
        ours(_tokens(torch.Generator().manual_seed(7), 1, 5))


def test_output_attentions_is_refused(reference):
    _, name = reference
    ours, _ = model_pair(tiny_config("llama"), name)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(_tokens(torch.Generator().manual_seed(8), 1, 5), output_attentions=True)


@pytest.mark.parametrize("feature", ["softcap", "s_aux", "position_bias", "indices"])
def test_features_cuflash_lacks_are_refused_by_name(reference, feature):
    with pytest.raises(NotImplementedError, match=feature):
        ct.attention_forward(_module(), *_qkv(), None, **{feature: torch.zeros(1)})


def test_four_d_and_mis_sized_masks_are_refused(reference):
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 1, 4, 4\)"):
        ct.attention_forward(_module(), *_qkv(), torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 3\)"):
        ct.attention_forward(_module(), *_qkv(), torch.ones(1, 3, dtype=torch.bool))
    layout = ct.attention_mask(batch_size=1, q_length=5, kv_length=5, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="built for batch 1, 5 queries"):
        ct.attention_forward(_module(), *_qkv(), layout)


def test_padding_between_real_tokens_is_refused(reference):
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        ct.attention_mask(batch_size=3, q_length=4, kv_length=4, attention_mask=mask)


def test_custom_mask_functions_are_refused(reference):
    with pytest.raises(NotImplementedError, match="or_mask_function"):
        ct.attention_mask(batch_size=1, q_length=4, kv_length=4, use_vmap=True)


def test_bidirectional_blocks_in_a_packed_mask_are_refused(reference):
    from transformers import masking_utils as mu

    blocks = torch.tensor([[-1, 0, 0, -1]])
    mask_function = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks))
    layout = ct.attention_mask(batch_size=1, q_length=4, kv_length=4, mask_function=mask_function,
                               allow_is_causal_skip=False)
    with pytest.raises(NotImplementedError, match="later one"):
        ct.attention_forward(_module(), *(torch.randn(1, h, 4, 8, dtype=torch.float64) for h in (4, 2, 2)), layout)


def test_packed_kwargs_on_another_device_or_incomplete_are_refused(reference):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_length_k"):
        ct.attention_forward(_module(), *_qkv(), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must be a 1-D int32.*shape \(1, 2\)"):
        ct.attention_forward(_module(), *_qkv(), None, cu_seq_lens_q=cu[None], cu_seq_lens_k=cu,
                             max_length_q=4, max_length_k=4)


def test_importing_cuflash_does_not_import_transformers():
    code = ("import sys, cuflash, cuflash.torch; "
            "assert 'transformers' not in sys.modules, 'cuflash imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bidirectional_padding_matches_masked_attention(reference):
    """A non-causal layer (encoder-style) with right padding: real queries see exactly the
    real keys; without padding the bidirectional mask function hands the layer None."""
    assert ct.attention_mask(batch_size=2, q_length=6, kv_length=6, allow_is_causal_skip=False,
                             allow_is_bidirectional_skip=True) is None
    mask = _padding_mask([6, 4], 6, "right").bool()
    layout = ct.attention_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=mask,
                               allow_is_causal_skip=False, allow_is_bidirectional_skip=True)
    q, k, v = (torch.randn(2, h, 6, 8, dtype=torch.float64) for h in (4, 2, 2))
    out, _ = ct.attention_forward(_module(causal=False), q, k, v, layout)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                                            enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out[mask], want[mask], **TOL)
    assert torch.all(out[~mask] == 0)
