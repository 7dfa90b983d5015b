"""examples/gpt: the same small GPT trained with SDPA and with cuflash attention agrees.

Both runs start from one seed (same initial weights, same batches), so they differ only by the
attention op's rounding in bf16. Needs a GPU and PyTorch with CUDA.
"""

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

from conftest import requires_gpu

torch = pytest.importorskip("torch")

pytestmark = [
    requires_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch sees no CUDA device"),
]

TRAIN_PY = Path(__file__).resolve().parent.parent / "examples" / "gpt" / "train.py"
SMALL = dict(n_layer=2, n_head=4, head_dim=64, seq_len=256, batch_size=8)
STEPS = 40


def load_example():
    spec = importlib.util.spec_from_file_location("cuflash_gpt_example", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt():
    return load_example()


@pytest.fixture(scope="module")
def curves(gpt):
    return {impl: gpt.train(impl, STEPS, 0, "cuda", **SMALL) for impl in ("sdpa", "cuflash")}


def test_loss_curves_agree(curves):
    sdpa, flash = curves["sdpa"], curves["cuflash"]
    assert len(sdpa) == len(flash) == STEPS
    assert all(math.isfinite(x) for x in sdpa + flash)
    # bf16 tolerance: each step within 0.05 absolute or 2% relative of the SDPA run
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(sdpa, flash))
           if abs(a - b) > max(0.05, 0.02 * abs(a))]
    assert not bad, f"steps where the losses differ beyond bf16 tolerance (step, sdpa, cuflash): {bad}"


def test_loss_decreases(curves):
    for impl, losses in curves.items():
        # from random init the first loss is about log(256) = 5.55
        assert abs(losses[0] - math.log(256)) < 0.5, (impl, losses[0])
        final = sum(losses[-5:]) / 5
        assert final < losses[0] - 1.5, f"{impl}: loss went from {losses[0]:.3f} to {final:.3f}"


def test_attention_gradients_agree(gpt):
    """One forward/backward on one batch: every parameter's gradient matches SDPA's."""
    cfg = gpt.GPTConfig(n_layer=2, n_head=4, head_dim=64, seq_len=256)
    data, _ = gpt.split(gpt.load_bytes())
    x, y = gpt.get_batch(data, 8, cfg.seq_len, torch.Generator().manual_seed(3), "cuda")
    grads = {}
    for impl in ("sdpa", "cuflash"):
        torch.manual_seed(0)
        model = gpt.GPT(cfg, impl).cuda()
        with gpt.autocast(torch.device("cuda")):
            loss = model(x, y)
        loss.backward()
        grads[impl] = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    for name, ref in grads["sdpa"].items():
        got = grads["cuflash"][name]
        # the fused projection's q, k and v rows separately, since dq and dk are small at
        # init; the k bias has an exactly-zero gradient (softmax ignores a per-row shift), so
        # a part is measured against at least 5% of the whole parameter's gradient
        parts = ("q", "k", "v") if ".attn.qkv." in name else ("",)
        floor = 0.05 * float(ref.norm()) + 1e-12
        for part, r, g in zip(parts, ref.chunk(len(parts)), got.chunk(len(parts))):
            err = float((g - r).norm()) / max(float(r.norm()), floor)
            assert err < 0.05, f"{name} {part}: relative gradient difference {err:.3g}"


def test_both_attentions_print_tokens_per_second(gpt, capsys):
    assert gpt.main(["--steps", "12", "--log-every", "0", "--sample", "0"]) == 0  # --attn both
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("tokens/s: sdpa "))
    found = re.match(r"tokens/s: sdpa ([\d,]+), cuflash ([\d,]+) ", line)
    assert found, line
    sdpa, flash = (float(x.replace(",", "")) for x in found.groups())  # thousands separated by commas
    assert sdpa > 0 and flash > 0 and f"(cuflash {flash / sdpa:.2f}x sdpa)" in line
    assert out.count("tokens/s after step 3") == 2
