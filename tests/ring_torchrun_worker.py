"""Ring attention on real ranks: run under torchrun, one process per rank.

    torchrun --standalone --nproc_per_node=2 tests/ring_torchrun_worker.py            # NCCL, one GPU a rank, bfloat16
    torchrun --standalone --nproc_per_node=3 tests/ring_torchrun_worker.py --cpu      # gloo, float64 reference

Every rank draws the same whole-sequence problem (rank 0 picks a fresh seed and broadcasts
it), runs ``cuflash.distributed.ring_attention`` forward and backward on its own shards over
torch.distributed (TorchDistributedCommunicator), and the results are gathered; rank 0 checks
them against the float64 reference (tests/ring_util.py: the project's accuracy rule in
bfloat16, 1e-12 in float64). Any failure raises, so torchrun exits non-zero.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuflash.distributed import CUFLASH_LOCAL, ring_attention  # noqa: E402
from ring_util import REFERENCE_LOCAL, check_ring_result, random_problem, sharded, whole  # noqa: E402

# (batch, Hq, Hk, chunk length, d, dv): a rank's shard is 1 (contiguous) or 2 (zigzag) chunks
GPU_SHAPES = ((1, 4, 4, 113, 64, 64), (2, 4, 2, 64, 128, 128))
CPU_SHAPES = ((2, 4, 4, 5, 8, 16), (1, 4, 2, 3, 8, 8))


def gathered(t: torch.Tensor) -> list:
    """Every rank's t (same shape on all ranks), on every rank."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def run_case(rank, world_size, device, dtype, seed, shape, causal, layout, local):
    batch, hq, hk, chunk, d, dv = shape
    n = world_size * chunk * (2 if layout == "zigzag" else 1)
    arrays = random_problem(np.random.default_rng(seed), batch, hq, hk, n, d, dv,
                            dtype="float64" if dtype == torch.float64 else "bfloat16")
    qs, ks, vs = sharded(arrays[:3], world_size, layout, dtype=dtype, device=device, requires_grad=True)
    (dos,) = sharded(arrays[3:], world_size, layout, dtype=dtype, device=device)
    q, k, v, do = qs[rank], ks[rank], vs[rank], dos[rank]
    out = ring_attention(q, k, v, causal=causal, layout=layout, return_stats=True, local_attention=local)
    out.o.backward(do)
    results = [gathered(x) for x in (out.o, q.grad, k.grad, v.grad, out.l[..., None], out.m[..., None])]
    if rank != 0:
        return None
    o, dq, dk, dv_, l, m = (whole(parts, layout) for parts in results)
    name = "float64" if dtype == torch.float64 else "bfloat16"
    return check_ring_result(o, (dq, dk, dv_), *arrays, causal=causal, dtype=name, stats=(l[..., 0], m[..., 0]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU with the float64 reference")
    args = parser.parse_args(argv)
    if args.cpu:
        backend, device, dtype, local, shapes = "gloo", torch.device("cpu"), torch.float64, REFERENCE_LOCAL, CPU_SHAPES
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        backend, device, dtype, local, shapes = "nccl", torch.device("cuda", local_rank), torch.bfloat16, CUFLASH_LOCAL, GPU_SHAPES
    dist.init_process_group(backend)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        seed = torch.tensor([int.from_bytes(os.urandom(7), "little") if rank == 0 else 0], device=device)
        dist.broadcast(seed, 0)
        for shape in shapes:
            for causal in (False, True):
                for layout in ("contiguous", "zigzag"):
                    errors = run_case(rank, world_size, device, dtype, int(seed.item()), shape, causal, layout, local)
                    if rank == 0:
                        print(f"ring W={world_size} {backend} {shape} causal={causal} {layout}: errors o, dq, dk, dv "
                              + " ".join(f"{e:.3g}" for e in errors), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
