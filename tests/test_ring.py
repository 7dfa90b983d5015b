"""cuflash.distributed.ring_attention on CPU: the whole ring algorithm (block plan, merges,
the backward's travelling dk/dv) over simulated ranks, with the float64 reference as the
local attention, against attention over the whole sequence; torch.distributed (gloo) under
torchrun; the layouts, the work each rank does, and argument checks."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cuflash import reference as ref  # noqa: E402
from cuflash.distributed import (LAYOUTS, LocalAttention, SimulatedRing, _blocks, ring_attention, shard_sequence,  # noqa: E402
                                 unshard_sequence)
from ring_util import (REFERENCE_LOCAL, RecordingLocal, allowed_pairs, check_ring_result, random_problem,  # noqa: E402
                       sharded, simulated_ring, whole)

# (batch, Hq, Hk, chunk length, d, dv): a rank's shard is one chunk (contiguous) or two (zigzag)
SHAPES = (
    (2, 4, 4, 17, 8, 16),
    (1, 4, 2, 64, 16, 8),  # grouped heads
    (1, 2, 1, 1, 8, 8),  # one key/value head for all; one-token chunks
)
SHAPE_IDS = ("chunk17", "gqa-chunk64", "kv1-chunk1")


def run_ring(arrays, world_size, layout, causal, local=REFERENCE_LOCAL):
    """Forward with stats and backward through autograd over a SimulatedRing; whole-sequence
    float64 results (o, (dq, dk, dv), (l, m))."""
    qs, ks, vs = sharded(arrays[:3], world_size, layout, requires_grad=True)
    (dos,) = sharded(arrays[3:], world_size, layout)
    return simulated_ring(qs, ks, vs, dos, world_size, layout, causal, local=local)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("world_size", range(1, 9))
def test_ring_matches_whole_sequence_attention(world_size, shape, causal, layout, rng):
    batch, hq, hk, chunk, d, dv = shape
    n = world_size * chunk * (2 if layout == "zigzag" else 1)
    arrays = random_problem(rng, batch, hq, hk, n, d, dv)
    o, grads, stats = run_ring(arrays, world_size, layout, causal)
    check_ring_result(o, grads, *arrays, causal=causal, dtype="float64", stats=stats)


@pytest.mark.parametrize("world_size", (2, 5))
def test_non_causal_shards_of_different_query_and_key_lengths(world_size, rng):
    """Cross-attention style: every rank's 3 queries see all ranks' 7 keys."""
    q = rng.standard_normal((1, 2, 3 * world_size, 8))
    k, v = rng.standard_normal((2, 1, 2, 7 * world_size, 8))
    do = rng.standard_normal(q.shape)
    qs, ks, vs = sharded((q, k, v), world_size, "contiguous", requires_grad=True)
    (dos,) = sharded((do,), world_size, "contiguous")
    outs = ring_attention(qs, ks, vs, communicator=SimulatedRing(world_size), local_attention=REFERENCE_LOCAL)
    torch.autograd.backward(outs, dos)
    grads = [whole([t.grad for t in shards], "contiguous") for shards in (qs, ks, vs)]
    check_ring_result(whole(outs, "contiguous"), grads, q, k, v, do, causal=False, dtype="float64")


def test_gradcheck_through_the_ring():
    """torch's numerical gradients of the ring itself (3 ranks, zigzag, causal, grouped heads),
    independent of the analytic reference backward the other tests compare with."""
    rng = np.random.default_rng(0)
    world_size = 3
    arrays = random_problem(rng, 1, 2, 1, world_size * 2 * 2, 8, 8)[:3]
    qs, ks, vs = sharded(arrays, world_size, "zigzag", requires_grad=True)

    def ring(*shards):
        outs = ring_attention(list(shards[:3]), list(shards[3:6]), list(shards[6:]), causal=True, layout="zigzag",
                              communicator=SimulatedRing(world_size), local_attention=REFERENCE_LOCAL)
        return tuple(outs)

    assert torch.autograd.gradcheck(ring, (*qs, *ks, *vs), fast_mode=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_agree_and_no_grad_matches(layout, rng):
    """Non-causal attention does not depend on where the keys live: either layout gives each
    query the same output; and a call under no_grad gives what the differentiable one does."""
    world_size = 4
    q, k, v = random_problem(rng, 1, 2, 2, world_size * 2 * 3, 8, 8)[:3]
    qs, ks, vs = sharded((q, k, v), world_size, layout, requires_grad=True)
    ring = SimulatedRing(world_size)
    with_grad = ring_attention(qs, ks, vs, communicator=ring, layout=layout, local_attention=REFERENCE_LOCAL)
    with torch.no_grad():
        without = ring_attention(qs, ks, vs, communicator=ring, layout=layout, local_attention=REFERENCE_LOCAL)
    assert all(not o.requires_grad for o in without) and all(o.requires_grad for o in with_grad)
    for a, b in zip(with_grad, without):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    np.testing.assert_allclose(whole(without, layout), ref.standard_attention(q, k, v).o, rtol=0, atol=1e-12)


def _rounded_to(dtype, tensors):
    return tuple(t.to(dtype) for t in tensors)


def _bf16_outputs_local():
    """The float64 reference on bfloat16 shards with cuflash's output dtypes: o and the
    gradients rounded to bfloat16, l and m float32 -- the roundings a ring adds to the
    kernels' own error (each block's o, and each block's gradient terms, in bfloat16)."""

    def forward(q, k, v, causal, scale):
        o, l, m = REFERENCE_LOCAL.forward(*_rounded_to(torch.float64, (q, k, v)), causal, scale)
        return o.to(torch.bfloat16), l.float(), m.float()

    def backward(do, q, k, v, o, l, m, causal, scale):
        grads = REFERENCE_LOCAL.backward(*_rounded_to(torch.float64, (do, q, k, v, o, l, m)), causal, scale)
        return _rounded_to(torch.bfloat16, grads)

    return LocalAttention(forward, backward)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("world_size", (2, 8))
def test_bf16_block_outputs_keep_the_ring_within_the_error_budget(world_size, causal, layout, rng):
    """W blocks a row, each block's o and gradient terms rounded to bfloat16 and summed in
    float32, stay inside the 2x / 3x budget of plain bfloat16 attention that the GPU tests
    hold the kernels to (measured: up to about 1.2x plain, so the kernels' own error must fit
    in what is left)."""
    chunk, n_dims = 24, (1, 4, 2)
    n = world_size * chunk * (2 if layout == "zigzag" else 1)
    arrays = random_problem(rng, *n_dims, n, 64, 64, dtype="bfloat16")
    qs, ks, vs = sharded(arrays[:3], world_size, layout, dtype=torch.bfloat16, requires_grad=True)
    (dos,) = sharded(arrays[3:], world_size, layout, dtype=torch.bfloat16)
    outs = ring_attention(qs, ks, vs, causal=causal, layout=layout, communicator=SimulatedRing(world_size),
                          local_attention=_bf16_outputs_local())
    assert all(o.dtype == torch.bfloat16 for o in outs)
    torch.autograd.backward(outs, dos)
    grads = tuple(whole([t.grad for t in shards], layout) for shards in (qs, ks, vs))
    check_ring_result(whole(outs, layout), grads, *arrays, causal=causal, dtype="bfloat16")


def test_blocks_reach_the_local_attention_as_cuflash_reads_them(rng):
    """What the ring hands its local attention meets cuflash's launch checks: l and m
    C-contiguous (the backward refuses strided statistics), do and o the rows' (.., Nq, dv),
    the last dim of every operand contiguous."""
    world_size, chunk = 3, 4
    arrays = random_problem(rng, 1, 4, 2, world_size * 2 * chunk, 8, 16)
    seen = []

    def backward(do, q, k, v, o, l, m, causal, scale):
        seen.append(causal)
        assert l.is_contiguous() and m.is_contiguous() and l.shape == m.shape == q.shape[:-1]
        assert do.shape == o.shape == q.shape[:-1] + v.shape[-1:]
        assert all(t.stride(-1) == 1 for t in (do, q, k, v, o))
        return REFERENCE_LOCAL.backward(do, q, k, v, o, l, m, causal, scale)

    o, grads, stats = run_ring(arrays, world_size, "zigzag", True, LocalAttention(REFERENCE_LOCAL.forward, backward))
    assert True in seen and False in seen
    check_ring_result(o, grads, *arrays, causal=True, dtype="float64", stats=stats)


# ---- the work each rank does -----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 7, 8))
def test_causal_blocks_cover_the_causal_pairs_exactly(world_size, layout):
    """Over all ranks and steps the blocks allow every causal (query, key) pair of the whole
    sequence once and nothing else (no skipped block is computed, none is missing), and the
    zigzag layout gives every rank the same work."""
    chunk = 5
    n_local = chunk * (2 if layout == "zigzag" else 1)
    n = n_local * world_size
    positions = shard_sequence(torch.arange(n)[:, None], world_size, layout)
    covered = np.zeros((n, n), dtype=int)
    work = []
    for rank in range(world_size):
        rank_work = 0
        for source in range(world_size):
            for block in _blocks(rank, source, world_size, layout, n_local, n_local, True):
                rows = positions[rank][block.q_start:block.q_stop, 0].numpy()
                cols = positions[source][:block.k_stop, 0].numpy()
                allowed = ref.allowed_keys(len(rows), len(cols), causal=block.causal)
                assert allowed.any(), f"rank {rank} computes an empty block {block} against rank {source}"
                covered[np.ix_(rows, cols)] += allowed
                rank_work += allowed_pairs(len(rows), len(cols), block.causal)
        work.append(rank_work)
    np.testing.assert_array_equal(covered, np.tril(np.ones((n, n), dtype=int)))
    if layout == "zigzag":
        assert len(set(work)) == 1, f"zigzag work per rank differs: {work}"


def test_ring_calls_only_the_planned_blocks(rng):
    """The forward calls the local attention once per planned block, with its shapes."""
    world_size, chunk = 4, 3
    q, k, v = random_problem(rng, 1, 1, 1, world_size * 2 * chunk, 8, 8)[:3]
    qs, ks, vs = sharded((q, k, v), world_size, "zigzag")
    recorder = RecordingLocal(REFERENCE_LOCAL)
    ring_attention(qs, ks, vs, causal=True, layout="zigzag", communicator=SimulatedRing(world_size),
                   local_attention=recorder.as_local())
    planned = sorted((b.q_stop - b.q_start, b.k_stop, b.causal)
                     for rank in range(world_size) for step in range(world_size)
                     for b in _blocks(rank, (rank - step) % world_size, world_size, "zigzag", 2 * chunk, 2 * chunk, True))
    assert sorted(recorder.calls) == planned
    # per rank: two diagonal calls on its own shard, one half-size full call per other shard
    assert len(recorder.calls) == world_size * (2 + world_size - 1)


# ---- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 3, 8))
def test_shard_and_unshard_are_inverse(world_size, layout):
    x = torch.arange(2 * world_size * 3 * 4).reshape(1, 2 * world_size * 3, 4)
    shards = shard_sequence(x, world_size, layout)
    assert len(shards) == world_size and all(s.shape == (1, 6, 4) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, layout), x, rtol=0, atol=0)


def test_shard_sequence_needs_a_divisible_length():
    with pytest.raises(ValueError, match=r"divisible by 6 \(zigzag layout over 3 ranks\), got shape \(2, 9, 4\)"):
        shard_sequence(torch.zeros(2, 9, 4), 3, "zigzag")
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        shard_sequence(torch.zeros(2, 9, 4), 0)


def test_zigzag_shards_hold_chunks_r_and_2w_minus_1_minus_r():
    shards = shard_sequence(torch.arange(8)[:, None], 2, "zigzag")
    assert [s[:, 0].tolist() for s in shards] == [[0, 1, 6, 7], [2, 3, 4, 5]]


# ---- torch.distributed (gloo) ----------------------------------------------------------------


def test_torch_distributed_ring_over_gloo():
    """The same checks with real ranks: 3 processes under torchrun, gloo on CPU, the float64
    reference as local attention, so TorchDistributedCommunicator's exchanges are exercised."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
               str(root / "tests" / "ring_torchrun_worker.py"), "--cpu"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("ring W=3 gloo") == 8, done.stdout


# ---- argument checks -------------------------------------------------------------------------


def shards_of(world_size, shape=(1, 2, 4, 8), kv_shape=None):
    kv_shape = kv_shape or shape
    return ([torch.zeros(shape, dtype=torch.float64) for _ in range(world_size)],
            [torch.zeros(kv_shape, dtype=torch.float64) for _ in range(world_size)],
            [torch.zeros(kv_shape, dtype=torch.float64) for _ in range(world_size)])


def call(qs, ks, vs, world_size=None, **options):
    world_size = world_size or len(qs)
    return ring_attention(qs, ks, vs, communicator=SimulatedRing(world_size), local_attention=REFERENCE_LOCAL,
                          **options)


@pytest.mark.parametrize("kv_shape,message", [
    ((1, 3, 4, 8), "Hk dividing Hq"),
    ((2, 2, 4, 8), "share B"),
    ((1, 2, 4, 16), "one d"),
])
def test_shape_errors_quote_the_shapes(kv_shape, message):
    qs, ks, vs = shards_of(2, kv_shape=kv_shape)
    with pytest.raises(ValueError, match=message) as info:
        call(qs, ks, vs)
    assert str(kv_shape) in str(info.value) and "(1, 2, 4, 8)" in str(info.value)


def test_rejects_three_dimensional_shards():
    qs, ks, vs = shards_of(2, shape=(2, 4, 8))
    with pytest.raises(ValueError, match=r"q\[0\] must be \(B, H, N_local, d\), got shape \(2, 4, 8\)"):
        call(qs, ks, vs)


def test_causal_needs_query_and_key_shards_of_one_length():
    qs, ks, vs = shards_of(2, shape=(1, 2, 4, 8), kv_shape=(1, 2, 6, 8))
    call(qs, ks, vs)  # fine without causal
    with pytest.raises(ValueError, match="same\npositions|same positions"):
        call(qs, ks, vs, causal=True)


def test_zigzag_causal_needs_an_even_shard():
    qs, ks, vs = shards_of(2, shape=(1, 2, 5, 8))
    with pytest.raises(ValueError, match="N_local must be even, got q\\[0\\] shape \\(1, 2, 5, 8\\)"):
        call(qs, ks, vs, causal=True, layout="zigzag")


def test_rejects_unknown_layout():
    with pytest.raises(ValueError, match="layout must be one of 'contiguous', 'zigzag', got 'striped'"):
        call(*shards_of(2), layout="striped")


def test_rejects_shards_of_different_shapes_across_ranks():
    qs, ks, vs = shards_of(3)
    ks[2] = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    vs[2] = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"every rank must pass k of one shape.*k\[2\] shape \(1, 2, 5, 8\)"):
        call(qs, ks, vs)


def test_rejects_a_rank_count_other_than_the_ring():
    qs, ks, vs = shards_of(3)
    with pytest.raises(ValueError, match="runs 4 ranks here: q, k and v must be sequences of 4 shards"):
        call(qs, ks, vs, world_size=4)
    with pytest.raises(ValueError, match="pass q, k and v as sequences of 2 shards, got a single tensor"):
        call(qs[0], ks[0], vs[0], world_size=2)


def test_rejects_mixed_dtypes_and_non_tensors():
    qs, ks, vs = shards_of(2)
    vs[1] = vs[1].float()
    with pytest.raises(ValueError, match=r"one dtype and device, got q\[1\] .*float64.* v\[1\] .*float32"):
        call(qs, ks, vs)
    qs, ks, vs = shards_of(2)
    qs[0] = qs[0].numpy()
    with pytest.raises(TypeError, match=r"q\[0\] must be a torch.Tensor, got numpy.ndarray"):
        call(qs, ks, vs)


def test_rejects_group_with_communicator_and_foreign_communicators():
    qs, ks, vs = shards_of(1)
    with pytest.raises(ValueError, match="either group .* or communicator, not both"):
        ring_attention(qs, ks, vs, group=object(), communicator=SimulatedRing(1))
    with pytest.raises(TypeError, match="communicator must be a cuflash.distributed.RingCommunicator, got dict"):
        ring_attention(qs, ks, vs, communicator={})


def test_torch_distributed_communicator_needs_an_initialised_group():
    q, k, v = (t[0] for t in shards_of(1))
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ring_attention(q, k, v, local_attention=REFERENCE_LOCAL)


def test_simulated_ring_reports_mismatched_exchanges_and_deadlocks():
    ring = SimulatedRing(2)

    def sends(shape):
        def program(rank):
            (got,) = yield ring.exchange(rank, (torch.zeros(shape[rank]),))
            return got.shape
        return program

    with pytest.raises(ValueError, match=r"simulated rank 0 expected tensors \[\(\(2,\), torch.float32\)\] from "
                                         r"rank 1, which sent \[\(\(3,\), torch.float32\)\]"):
        ring.run([sends((2, 3))(r) for r in range(2)])
    assert ring.run([sends((4, 4))(r) for r in range(2)]) == [(4,), (4,)]

    def waits_without_sending(rank):
        yield ring.exchange(rank, ()) if rank == 0 else _Never()

    class _Never:
        def ready(self):
            return False

    with pytest.raises(RuntimeError, match=r"deadlock: ranks \[0, 1\] wait"):
        ring.run([waits_without_sending(r) for r in range(2)])
