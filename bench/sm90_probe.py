"""Tuning probe for the wgmma forward: forward TFLOP/s of (block_cols, stages, overlap,
pingpong, tma, persistent[, exp emulation[, early next[, snake]]]) settings
of kernels/flash_fwd_sm90.cu next to the mma.sync kernel and SDPA's flash and cuDNN backends,
in one process on one GPU (bf16, 16k tokens, hidden 2048, as cuflash-bench; --tokens for more).

    python bench/sm90_probe.py [--seqlens 4096 16384] [--configs 128,3,0,1,1,1 128,3,0,0,0,0 ...]
                               [--tokens 262144]
"""

import argparse
import contextlib
import statistics

import torch

import cuflash
from cuflash import _config


def time_ms(fn, repeats=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


@contextlib.contextmanager
def switched(hd, config):
    """The wgmma forward's table set to one probe config: (block_cols, stages, overlap, pingpong,
    tma, persistent), a 7th number for exp emulation (every n-th tile), an 8th for early_next
    and a 9th for snake."""
    bc, stages, *flags = config
    emulation, early, snake = (list(flags[4:7]) + [0, 0, 0])[:3]
    with _config.sm90_tiles_override({hd: (bc, stages, *map(bool, flags[:4]))}), \
            _config.sm90_exp_emulation_override({hd: emulation}), \
            _config.sm90_early_next_override({hd: bool(early)}), _config.sm90_snake_override({hd: bool(snake)}):
        yield


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384,
                        help="batch x seq (16x more at seq 512-1024 hides cuflash's host time in each call)")
    parser.add_argument("--configs", nargs="+",
                        default=["128,3,0,0,0,0", "128,3,0,1,0,0", "128,3,0,0,1,0", "128,3,0,1,1,0",
                                 "128,3,0,1,1,1", "128,3,1,1,1,1"])
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Build every variant the run needs first, in parallel processes (one at a time, inside the
    # timing loop's warm-up, they took most of a call's time limit).
    from cuflash import compile_check

    needed = {}
    for hd in args.hdims:
        for causal in (False, True):
            for seq in args.seqlens:
                for config in configs:
                    with switched(hd, config):
                        variant = _config.forward_config("bfloat16", hd, hd, causal, wgmma=True, nq=seq)
                    needed[variant.key] = variant
            mma_sync = _config.forward_config("bfloat16", hd, hd, causal)
            needed[mma_sync.key] = mma_sync
    compile_check.warm(variants=needed.values())

    print("hdim causal seq | " + " | ".join(f"sm90{c}" for c in configs) + " | mma.sync | sdpa_flash | sdpa_cudnn")
    for hd in args.hdims:
        for causal in (False, True):
            for seq in args.seqlens:
                batch, heads = max(1, args.tokens // seq), 2048 // hd
                q, k, v = (torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * seq * seq * hd * heads * batch / (2 if causal else 1)
                row = []
                for config in configs:
                    with switched(hd, config):
                        row.append(time_ms(lambda: cuflash.attention(q, k, v, causal=causal)))
                with _config.wgmma_forward(False):
                    row.append(time_ms(lambda: cuflash.attention(q, k, v, causal=causal)))
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    with sdpa_kernel(backend):
                        row.append(time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)))
                print(f"{hd} {int(causal)} {seq} | " + " | ".join(f"{flops / t / 1e9:.0f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
