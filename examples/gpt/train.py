"""A small byte-level GPT trained from scratch, with switchable attention: PyTorch SDPA or cuflash.

    python examples/gpt/train.py --attn cuflash --steps 200
    python examples/gpt/train.py --attn sdpa --steps 200
    python examples/gpt/train.py --attn both --steps 200     # both from one seed, side by side

The model: byte embeddings (vocabulary 256) plus learned positions, pre-LayerNorm transformer
blocks (causal self-attention, GELU MLP), a final LayerNorm and an output layer tied to the
byte embedding. It trains on examples/gpt/data.txt with AdamW under bf16 autocast (fp32 master
weights). The only thing --attn changes is the attention op inside each block:

    sdpa:    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    cuflash: cuflash.torch.attention(q, k, v, causal=True)

q, k and v are (batch, heads, seq, head_dim) strided views of one fused projection; both ops
read them in place. Everything else (initialisation, batch order) depends on the seed alone, so
two runs with one seed differ only by the attention op's rounding.

`train(attn_impl, steps, seed, device, ...)` returns the per-step training losses (the test
tests/test_gpt_example.py compares the two ops with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
DATA = HERE / "data.txt"
ATTN_IMPLS = ("sdpa", "cuflash")
VOCAB = 256  # bytes


@dataclasses.dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    head_dim: int = 64
    seq_len: int = 256
    vocab: int = VOCAB

    @property
    def n_embd(self) -> int:
        return self.n_head * self.head_dim


def attention_op(attn_impl: str) -> Callable:
    """fn(q, k, v) -> o for (batch, heads, seq, head_dim) tensors, causal."""
    if attn_impl == "sdpa":
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa
    if attn_impl == "cuflash":
        try:
            import cuflash.torch
        except ImportError:  # run from a checkout without installing: use the repo's package
            sys.path.insert(0, str(REPO_ROOT))
            import cuflash.torch

        def flash(q, k, v):
            return cuflash.torch.attention(q, k, v, causal=True)
        return flash
    raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")


# ---- the model ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attend: Callable):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attend = attend

    def forward(self, x):
        b, n, c = x.shape
        # (b, n, 3, h, d) -> three (b, h, n, d) views; the last dim stays contiguous
        qkv = self.qkv(x).view(b, n, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attend: Callable):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attend)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str):
        super().__init__()
        self.cfg = cfg
        attend = attention_op(attn_impl)
        self.tok = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for block in self.blocks:  # residual projections scaled down with depth (GPT-2)
            for layer in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        n = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ---- data and training -------------------------------------------------------------------


def load_bytes(path: Path = DATA) -> torch.Tensor:
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


def split(data: torch.Tensor, val_fraction: float = 0.1):
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


def get_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device):
    """`batch` random windows of seq + 1 bytes; the order depends on `gen` alone."""
    starts = torch.randint(len(data) - seq - 1, (batch,), generator=gen)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    windows = windows.to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclasses.dataclass
class Run:
    model: GPT
    losses: list
    seconds: float  # the whole run, compilation on the first steps included
    tokens: int
    steady_tokens_per_s: Optional[float]  # the steps after the first `warm_steps`, None if none


def warm_steps(steps: int) -> int:
    """Steps left out of the steady tokens/s: the first ones compile kernels and grow the
    allocator (a quarter of the run, at most 10)."""
    return min(10, steps // 4)


def train_model(attn_impl: str = "cuflash", steps: int = 200, seed: int = 0,
                device: str = "cuda", *, n_layer: int = 2, n_head: int = 4, head_dim: int = 64,
                seq_len: int = 256, batch_size: int = 8, lr: float = 1e-3,
                warmup: Optional[int] = None, log_every: int = 0,
                data_path: Path = DATA) -> Run:
    """Train from random init; returns the model and the loss of every step."""
    device = torch.device(device)
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, head_dim=head_dim, seq_len=seq_len)
    torch.manual_seed(seed)
    model = GPT(cfg, attn_impl).to(device)
    optimizer = make_optimizer(model, lr)
    train_data, _ = split(load_bytes(data_path))
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 10) if warmup is None else warmup
    losses = []
    start = time.perf_counter()
    tick, tick_step = start, 0
    steady_from, steady_start = warm_steps(steps), None
    for step in range(steps):
        if step == steady_from and step > 0:
            synchronize(device)
            steady_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = get_batch(train_data, batch_size, seq_len, gen, device)
        with autocast(device):
            loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            now = time.perf_counter()
            ms = 1e3 * (now - tick) / (step + 1 - tick_step)
            print(f"[{attn_impl}] step {step + 1:5d}/{steps}  loss {losses[-1]:.4f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  {ms:7.1f} ms/step", flush=True)
            tick, tick_step = now, step + 1
    synchronize(device)
    end = time.perf_counter()
    steady = ((steps - steady_from) * batch_size * seq_len / (end - steady_start)
              if steady_start is not None and end > steady_start else None)
    return Run(model, losses, end - start, steps * batch_size * seq_len, steady)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(attn_impl: str = "cuflash", steps: int = 200, seed: int = 0, device: str = "cuda",
          **options) -> list:
    """Per-step training losses (floats) of a fresh model; options go to train_model."""
    return train_model(attn_impl, steps, seed, device, **options).losses


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, batches: int = 8, batch_size: int = 8,
             seed: int = 1234) -> float:
    """Mean loss over fixed random windows of `data`."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(data, batch_size, model.cfg.seq_len, gen, device)
        with autocast(device):
            total += model(x, y).item()
    model.train()
    return total / batches


@torch.no_grad()
def sample(model: GPT, prompt: str, length: int, temperature: float = 0.8,
           seed: int = 0) -> str:
    """Continue `prompt` by `length` bytes (the whole window is recomputed for each byte)."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long, device=device)
    for _ in range(length):
        window = idx[:, -model.cfg.seq_len:]
        with autocast(device):
            logits = model(window)[:, -1, :].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# ---- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a small byte-level GPT with SDPA or cuflash "
                                            "attention on examples/gpt/data.txt.")
    p.add_argument("--attn", choices=ATTN_IMPLS + ("both",), default="both",
                   help="attention op (both: train one model with each, same seed, and compare "
                        "their tokens/s) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    p.add_argument("--sample", type=int, default=200,
                   help="bytes to generate after training (0: none)")
    p.add_argument("--data", type=Path, default=DATA, help="training text (bytes)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    options = dict(n_layer=args.layers, n_head=args.heads, head_dim=args.head_dim,
                   seq_len=args.seq, batch_size=args.batch, lr=args.lr,
                   log_every=args.log_every, data_path=args.data)
    impls = ATTN_IMPLS if args.attn == "both" else (args.attn,)
    _, val_data = split(load_bytes(args.data))
    runs = {}
    for impl in impls:
        run = train_model(impl, args.steps, args.seed, args.device, **options)
        runs[impl] = run
        params = sum(p.numel() for p in run.model.parameters())
        print(f"[{impl}] {params / 1e6:.2f} M parameters, {run.seconds:.1f} s, "
              f"{tokens_per_s_text(run)}; final train loss {run.losses[-1]:.4f}, "
              f"validation loss {evaluate(run.model, val_data):.4f}", flush=True)
        if args.sample:
            text = sample(run.model, "LOG, ", args.sample, seed=args.seed)
            print(f"[{impl}] sample:\n{text}\n", flush=True)
    if len(runs) == 2:
        a, b = (runs[i].losses for i in ATTN_IMPLS)
        diffs = [abs(x - y) for x, y in zip(a, b)]
        print(f"max |loss_sdpa - loss_cuflash| over {len(diffs)} steps: {max(diffs):.4f} "
              f"(mean {sum(diffs) / len(diffs):.4f})")
        print(speed_comparison(runs["sdpa"], runs["cuflash"]), flush=True)
    return 0


def tokens_per_s_text(run: Run) -> str:
    whole = f"{run.tokens / run.seconds:,.0f} tokens/s over the whole run"
    if run.steady_tokens_per_s is None:
        return whole
    return (f"{run.steady_tokens_per_s:,.0f} tokens/s after step {warm_steps(len(run.losses))} "
            f"({whole}, compilation included)")


def speed_comparison(sdpa: Run, flash: Run) -> str:
    """One line: both attentions' training throughput and their ratio."""
    def rate(run):
        return run.steady_tokens_per_s or run.tokens / run.seconds
    return (f"tokens/s: sdpa {rate(sdpa):,.0f}, cuflash {rate(flash):,.0f} "
            f"(cuflash {rate(flash) / rate(sdpa):.2f}x sdpa)")


if __name__ == "__main__":
    sys.exit(main())
