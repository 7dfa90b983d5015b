"""Where the block-sparse backward's time goes (issue 4): the wgmma backward at head dim 128 on
the sparse table's masks, with dQ added by bulk reductions and by vector atomics, against the
mma.sync backward; and the dense backward at short sequences, where a CTA walks as few query
tiles as a sparse one. bf16, 16k tokens, hidden 2048, as cuflash-bench. Each time is the
median over rounds of 10 calls queued back to back (host time hidden, as in the bench).

    python bench/sparse_bwd_probe.py
"""

import statistics

import cupy
import torch

import cuflash
from cuflash import _config
from cuflash import masks as M

FORMS = (("bulk dQ", dict(bulk=True, wgmma=True)), ("vector dQ", dict(bulk=False, wgmma=True)),
         ("mma.sync", dict(bulk=None, wgmma=False)))


def queued_ms(fn, calls=10, rounds=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def backward_ms(seq, mask, form):
    batch, heads, hd = 16384 // seq, 16, 128
    q, k, v, do = (cupy.from_dlpack(torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16))
                   for _ in range(4))
    extra = {} if mask is None else {"block_mask": mask}
    with _config.wgmma_backward(form["wgmma"]), _config.sm90_bulk_dq(form["bulk"]):
        saved = cuflash.attention(q, k, v, **extra)
        return queued_ms(lambda: cuflash.attention_backward(do, q, k, v, *saved, **extra))


def main():
    print("bwd ms (hd128 bf16) | " + " | ".join(name for name, _ in FORMS), flush=True)
    n = 16384 // 128
    for label, mask in (("dense 16k", None), ("local(128, 2) 16k", M.local(n, 2)),
                        ("butterfly(128) 16k", M.butterfly(n)), ("random(128, 0.1) 16k", M.random(n, 0.1, 0))):
        density = 1.0 if mask is None else float(mask.density)
        cells = [f"{backward_ms(16384, mask, form):.3f}" for _, form in FORMS]
        print(f"{label} d={density:.3f} | " + " | ".join(cells), flush=True)
    for seq in (512, 1024, 2048):
        cells = [f"{backward_ms(seq, None, form):.3f}" for _, form in FORMS]
        print(f"dense {seq} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
