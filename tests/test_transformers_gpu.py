"""cuflash.transformers on a GPU: tiny models from configs run with the real cuflash kernels
in bfloat16 and float32, against transformers' "sdpa" on the same weights in the same dtype.

Accuracy rule, the model-level form of the kernels' rule: against the same model in float64
(sdpa), cuflash's logits may be at most 2x as far off as sdpa's in the same dtype, and its
parameter gradients 3x, plus a floor of 1e-6 of the reference's largest value (two float32
runs can both land within rounding of float64, where a ratio means nothing). The rest of the
model (projections, norms, MLP) runs the same dtype in both, so most of either error is shared
and a wrong mask, window or head grouping shows up as an error many times sdpa's.

Before each forward the torch caching allocator's free blocks are filled with NaN, so an output
element cuflash fails to write (the zero rows of padded queries included) shows as NaN in the
logits, which must be finite everywhere, padded positions too.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from conftest import HAS_GPU

transformers = pytest.importorskip("transformers")

from hf_util import VOCAB, model_pair, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()), reason="needs a CUDA GPU and torch")

DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def name():
    import cuflash.transformers

    return cuflash.transformers.register()


def _poison_free_memory():
    """Fill the caching allocator's free blocks with NaN: outputs allocated from them start as NaN.
    Blocks of falling sizes are taken until the allocator has to reserve a new segment (which
    is poisoned too), so the free blocks of every size class are covered."""
    chunks = []
    for size in (1 << 24, 1 << 20, 1 << 16, 1 << 10):  # bytes
        reserved = torch.cuda.memory_reserved()
        while True:
            chunks.append(torch.empty(size // 4, dtype=torch.float32, device="cuda").fill_(float("nan")))
            if torch.cuda.memory_reserved() > reserved:
                break
    del chunks


def _three_models(kind, name, dtype):
    """(cuflash in dtype, sdpa in dtype, sdpa in float64), one set of weights."""
    ours, sdpa = model_pair(tiny_config(kind), name, dtype=torch.float32, device="cuda")
    exact = copy.deepcopy(sdpa).to(torch.float64)
    return ours.to(dtype), sdpa.to(dtype), exact


def _err(a, b, keep=None):
    diff = (a.double() - b.double()).abs()
    return (diff if keep is None else diff[keep]).max().item()


def _check(ours, sdpa, exact, keep=None, what="logits", factor=2.0):
    assert torch.isfinite(ours).all(), f"{what}: NaN or inf (an unwritten output?)"
    floor = 1e-6 * exact.abs().max().item()
    err, base = _err(ours, exact, keep), _err(sdpa, exact, keep)
    assert err <= factor * base + floor, f"{what}: cuflash error {err:.3g} > {factor} x sdpa's {base:.3g} + {floor:.2g}"


def _forward_backward(models, call, keep=None):
    """Run call(model) -> logits on each model, backward of a fixed random projection of the
    kept logits; compare logits (2x) and every parameter's gradient (3x)."""
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = None
    for model in models:
        model.zero_grad()
        _poison_free_memory()
        logits = call(model)
        if weights is None:
            weights = torch.randn(logits.shape, generator=g, device="cuda", dtype=torch.float64)
        kept = logits.double() * weights
        (kept if keep is None else kept[keep]).sum().backward()
        results.append((logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    (lo, go), (ls, gs), (le, ge) = results
    _check(lo, ls, le, keep)
    for n in ge:
        _check(go[n], gs[n], ge[n], what=f"grad {n}", factor=3.0)


def _tokens(seed, *shape):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_causal_forward_and_backward(name, kind, dtype):
    models = _three_models(kind, name, dtype)
    x = _tokens(1, 2, 113)
    _forward_backward(models, lambda m: m(x).logits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_forward_and_backward(name, kind, dtype, side):
    models = _three_models(kind, name, dtype)
    lengths, width = [113, 17, 1, 64], 113
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, width - n:] = 1
    x = _tokens(2, len(lengths), width)
    _forward_backward(models, lambda m: m(x, attention_mask=mask).logits, keep=mask.bool())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_left_padded_decode_steps_with_a_cache(name, kind, dtype):
    """Prefill of left-padded prompts, then decode steps (one query against the cache, qwen2's
    sliding layer dropping old keys), every model fed the float64 model's greedy tokens."""
    ours, sdpa, exact = _three_models(kind, name, dtype)
    lengths, width = [17, 5, 1], 17
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    tokens = _tokens(3, len(lengths), width).masked_fill(mask == 0, 0)
    caches = [None, None, None]
    step_input = tokens
    with torch.no_grad():
        for step in range(4):
            outs = []
            for i, model in enumerate((ours, sdpa, exact)):
                _poison_free_memory()
                out = model(step_input, attention_mask=mask, past_key_values=caches[i], use_cache=True)
                caches[i] = out.past_key_values
                outs.append(out.logits[:, -1])
            _check(*outs, what=f"step {step} logits")
            step_input = outs[2].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_generate_runs_left_padded(name, dtype):
    ours, _, _ = _three_models("qwen2", name, dtype)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], device="cuda")
    prompts = _tokens(4, 2, 7).masked_fill(mask == 0, 0)
    out = ours.generate(prompts, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0,
                        eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    assert out.sequences.shape == (2, 16)
    assert all(torch.isfinite(step).all() for step in out.logits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_forward_and_backward(name, kind, dtype, flash_kwargs):
    models = _three_models(kind, name, dtype)
    g = torch.Generator().manual_seed(5)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (113, 1, 17, 64, 2)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
    # sdpa (and the float64 reference) honour packing through position_ids in a forward without a cache.
    _forward_backward(models, lambda m: m(**batch, use_cache=False).logits)
