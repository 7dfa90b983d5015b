"""Padding-free fine-tuning of a Hugging Face model through cuflash: a tiny Llama-style model
(GQA, built from a config, nothing downloaded) trained on packed batches of the GPT example's
corpus, once with cuflash and once with transformers' sdpa, printing loss and tokens/s.

    python examples/hf_packed_finetune.py                  # both, 30 steps each
    python examples/hf_packed_finetune.py --impl cuattn --steps 100

Each batch is a list of documents (lines of examples/gpt/data.txt, as bytes) flattened into one
row by transformers' DataCollatorWithFlattening with ``return_flash_attn_kwargs=True``: the
attention layers get ``cu_seq_lens_q/k`` and ``max_length_q/k`` and cuflash runs its
variable-length path, so no token attends across a document boundary and no padding is
computed. sdpa reads the same boundaries from the restarting ``position_ids`` and builds a
(tokens x tokens) mask. Both runs start from the same weights and see the same batches.

Needs a CUDA GPU, PyTorch and transformers (``pip install ".[cuda12,transformers]"``); the
module imports without them.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "gpt" / "data.txt"
SPECIAL = 3  # token ids 0, 1, 2: padding, begin, end; byte b is token b + SPECIAL
MODEL = dict(vocab_size=256 + SPECIAL, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def documents(path: Path = DATA, min_bytes: int = 8):
    """The corpus's lines as token lists: begin, the line's bytes, end."""
    lines = path.read_bytes().split(b"\n")
    return [[1, *(b + SPECIAL for b in line), 2] for line in lines if len(line) >= min_bytes]


def packed_batches(docs, tokens_per_batch: int, seed: int = 0):
    """Shuffled documents grouped into batches of at most tokens_per_batch tokens, forever (a
    batch left open at the end of a pass over the corpus is filled from the next pass)."""
    rng = random.Random(seed)
    batch, size = [], 0
    while True:
        order = docs[:]
        rng.shuffle(order)
        for doc in order:
            doc = doc[:tokens_per_batch]
            if size + len(doc) > tokens_per_batch and batch:
                yield batch
                batch, size = [], 0
            batch.append(doc)
            size += len(doc)


def build_model(impl: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**MODEL)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.bfloat16).cuda()


def train(impl: str, steps: int, tokens_per_batch: int, seed: int = 0, lr: float = 2e-3, log_every: int = 10):
    """Train a fresh model; returns (losses per step, tokens per second after the first steps)."""
    import torch
    import transformers

    model = build_model(impl, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batches = packed_batches(documents(), tokens_per_batch, seed)
    warmup = min(3, steps - 1)  # kernel compilation and allocator warm-up are not timed
    losses, tokens, start = [], 0, None
    for step in range(steps):
        if step == warmup:
            torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
        batch = collate([{"input_ids": doc} for doc in next(batches)])
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += batch["input_ids"].numel()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  {impl:>8}  step {step:4d}  loss {losses[-1]:.4f}")
    torch.cuda.synchronize()
    return losses, tokens / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["both", "cuattn", "sdpa"], default="both")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    args = parser.parse_args(argv)

    import cuflash.transformers

    name = cuflash.transformers.register()
    impls = {"both": [name, "sdpa"], "cuattn": [name], "sdpa": ["sdpa"]}[args.impl]
    results = {}
    for impl in impls:
        print(f"{impl}: {args.steps} steps of {args.tokens_per_batch} packed tokens")
        results[impl] = train(impl, args.steps, args.tokens_per_batch)
    print(f"\n{'attention':>10}  {'first loss':>10}  {'last loss':>10}  {'tokens/s':>10}")
    for impl, (losses, rate) in results.items():
        print(f"{impl:>10}  {losses[0]:10.4f}  {losses[-1]:10.4f}  {rate:10.0f}")
    return results


if __name__ == "__main__":
    main()
