"""cuflash.distributed: context parallelism -- ring attention over torch.distributed.

A sequence too long for one GPU is sharded along its length over the W ranks of a process
group. Every rank keeps its query shard; the key/value shards travel around the ring (rank r
sends to r + 1 and receives from r - 1), and after W steps every rank has seen every key
(Liu et al., "Ring Attention with Blockwise Transformers", 2023)::

    step t, rank r:  start sending the K/V shard it holds to r + 1, receiving r - 1's
                     attention of its queries against the shard it holds (cuflash's kernels)
                     merge that block's (o, l, m) into the running result (cuflash.merge)
                     wait for the exchange: it now holds shard (r - t - 1) mod W

The exchange of step t runs while step t computes (NCCL works on its own stream). The merge
is exact -- attention over disjoint key sets combines from the parts' statistics -- so the
result is attention over the whole sequence. The backward recomputes every block with cuflash's
backward given the merged (global) o, l and m, with which each block's dq, dk and dv
contributions are exact; dq stays on its rank, dk and dv travel the ring with their K/V and
arrive at the shard's owner after W exchanges.

Causal attention over the whole sequence skips the blocks above the diagonal. With the
``"contiguous"`` layout rank r holds positions [r n, (r + 1) n), so it computes r full blocks
and one diagonal one: the last rank works W times as long as the first. The ``"zigzag"``
layout cuts the sequence into 2W chunks and gives rank r chunks r and 2W - 1 - r, so every
rank computes the same amount (two diagonal chunk pairs on its own shard, then, per visiting
shard, half of the chunk pairs: either both its query chunks against the visitor's first
chunk, or its second query chunk against both). :func:`shard_sequence` cuts a whole sequence
into either layout, :func:`unshard_sequence` puts it back together.

The algorithm is written once, as one generator per rank that yields where it must wait for
an exchange; a :class:`RingCommunicator` starts exchanges and drives the generators:
:class:`TorchDistributedCommunicator` for real ranks (one generator per process, NCCL or gloo),
:class:`SimulatedRing` for W simulated ranks in one process (all generators in lock step,
tensors handed over by reference), which lets tests run the very same code on one GPU or on a
CPU. The attention of one block is a :class:`LocalAttention`: cuflash's kernels by default,
or any function with the same contract (the tests pass the float64 NumPy reference).
"""

from __future__ import annotations

import abc
import functools
import math
from typing import Callable, Generator, NamedTuple, Optional, Sequence

import torch

from . import torch as cuflash_torch
from ._api import AttentionOutput
from ._merge import merge

__all__ = [
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "LAYOUTS",
    "LocalAttention",
    "CUFLASH_LOCAL",
    "RingCommunicator",
    "TorchDistributedCommunicator",
    "SimulatedRing",
]

LAYOUTS = ("contiguous", "zigzag")


# ---- how a sequence is sharded -------------------------------------------------------------


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def _chunks_per_rank(layout) -> int:
    return 1 if layout == "contiguous" else 2


def _chunks_of_rank(rank: int, world_size: int, layout: str) -> tuple:
    """Which of the sequence's W * _chunks_per_rank(layout) equal chunks rank ``rank`` holds,
    in the order its shard stores them: ascending in both layouts, which :func:`_blocks`
    relies on."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def shard_sequence(x: torch.Tensor, world_size: int, layout: str = "contiguous") -> list:
    """Cut x (..., N, d) along its sequence axis (-2) into the W shards of ``layout``.

    N must be a multiple of W (contiguous) or of 2W (zigzag). Contiguous shards are views of
    x; zigzag shards are new tensors (two chunks each, concatenated).

    Example:
        >>> q_shards = shard_sequence(q, 4, "zigzag")     # q_shards[r] goes to rank r
    """
    _check_layout(layout)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    chunks = world_size * _chunks_per_rank(layout)
    if x.dim() < 2 or x.shape[-2] % chunks:
        raise ValueError(f"x must have a sequence axis (-2) of a length divisible by {chunks} "
                         f"({layout} layout over {world_size} ranks), got shape {tuple(x.shape)}")
    pieces = torch.chunk(x, chunks, dim=-2)
    return [pieces[c[0]] if len(c) == 1 else torch.cat([pieces[i] for i in c], dim=-2)
            for c in (_chunks_of_rank(r, world_size, layout) for r in range(world_size))]


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence from the W shards of ``layout`` (:func:`shard_sequence`'s inverse)."""
    _check_layout(layout)
    world_size = len(shards)
    per_rank = _chunks_per_rank(layout)
    chunks = [None] * (world_size * per_rank)
    for rank, shard in enumerate(shards):
        if shard.shape[-2] % per_rank:
            raise ValueError(f"shard {rank} of the {layout} layout must hold {per_rank} equal chunks, "
                             f"got shape {tuple(shard.shape)}")
        for index, piece in zip(_chunks_of_rank(rank, world_size, layout), torch.chunk(shard, per_rank, dim=-2)):
            chunks[index] = piece
    return torch.cat(chunks, dim=-2)


class _Block(NamedTuple):
    """One local attention call: queries [q_start, q_stop) of a rank's shard against keys
    [0, k_stop) of the shard it holds, with the (bottom-right aligned) causal mask or none."""

    q_start: int
    q_stop: int
    k_stop: int
    causal: bool


@functools.lru_cache(maxsize=1024)
def _blocks(rank: int, source: int, world_size: int, layout: str, n_q: int, n_k: int, causal: bool) -> tuple:
    """The blocks rank ``rank`` computes against the shard of rank ``source``.

    Not causal: all queries against all keys. Causal, per query chunk c (global index): the
    key chunks before c are fully visible, chunk c itself is the diagonal, later ones are
    skipped. A shard stores its chunks in ascending order, so the visible key chunks are a
    prefix of the shard; when the prefix ends with c, cuflash's causal mask on (chunk c's
    queries, the prefix) is exactly the global one, because the mask is bottom-right aligned
    and all chunks are equally long. Query chunks that see the same full prefix share one call.
    """
    if not causal:
        return (_Block(0, n_q, n_k, False),)
    query_chunks = _chunks_of_rank(rank, world_size, layout)
    key_chunks = _chunks_of_rank(source, world_size, layout)
    size = n_q // len(query_chunks)
    blocks = []
    for index, chunk in enumerate(query_chunks):
        visible = sum(1 for c in key_chunks if c <= chunk)
        if visible == 0:
            continue
        block = _Block(index * size, (index + 1) * size, visible * size, key_chunks[visible - 1] == chunk)
        last = blocks[-1] if blocks else None
        if (last is not None and not last.causal and not block.causal and last.k_stop == block.k_stop
                and last.q_stop == block.q_start):
            blocks[-1] = last._replace(q_stop=block.q_stop)
        else:
            blocks.append(block)
    return tuple(blocks)


# ---- the attention of one block ------------------------------------------------------------


class LocalAttention(NamedTuple):
    """The attention of one (query rows, key shard) block, forward and backward.

    forward(q, k, v, causal, scale) -> (o, l, m): o in q's dtype, l and m (float32 or
        float64) with cuflash's meaning (:class:`cuflash.AttentionOutput`); ``causal`` is
        bottom-right aligned, ``scale`` None means 1 / sqrt(d).
    backward(do, q, k, v, o, l, m, causal, scale) -> (dq, dk, dv): shaped like q, k, v, for
        the o, l, m given (the ring passes the merged, global ones: the block's contribution).
    Both take (B, H, N, d) tensors, k and v with Hk heads dividing q's Hq, and must not write
    into their arguments.
    """

    forward: Callable
    backward: Callable


def _cuflash_forward(q, k, v, causal, scale):
    return cuflash_torch._forward_impl(q, k, v, causal, scale, None, None)


def _cuflash_backward(do, q, k, v, o, l, m, causal, scale):
    return cuflash_torch._backward_impl(do, q, k, v, o, l, m, causal, scale, None, None,
                                        torch.are_deterministic_algorithms_enabled())


#: cuflash's kernels on CUDA tensors (torch's current stream), as cuflash.torch.attention runs them.
CUFLASH_LOCAL = LocalAttention(_cuflash_forward, _cuflash_backward)


# ---- communicators -------------------------------------------------------------------------


class PendingExchange(abc.ABC):
    """An exchange under way; ``wait()`` gives the tensors received from the previous rank."""

    @abc.abstractmethod
    def wait(self) -> tuple:
        ...


class RingCommunicator(abc.ABC):
    """The ring operations ring attention needs, and the running of its per-rank steps.

    ``world_size``: ranks in the ring. ``ranks``: the ranks whose steps this process runs (its
    own rank under torch.distributed; all of them in a simulation).
    """

    world_size: int
    ranks: tuple

    @abc.abstractmethod
    def exchange(self, rank: int, tensors: Sequence[torch.Tensor]) -> PendingExchange:
        """Start sending ``tensors`` from ``rank`` to rank + 1 and receiving tensors of the same
        shapes and dtypes from rank - 1. The sent tensors must stay unchanged until the
        exchange is waited on (a simulated ring hands over the tensors themselves)."""

    @abc.abstractmethod
    def run(self, programs: Sequence[Generator]) -> list:
        """Run one program per rank of ``ranks`` to its end and return their results.

        A program is a generator that yields a :class:`PendingExchange` where it must wait
        for it, and is sent back the received tensors."""


def _run_blocking(program: Generator):
    """Drive one program, waiting on each exchange it yields."""
    try:
        pending = next(program)
        while True:
            pending = program.send(pending.wait())
    except StopIteration as finished:
        return finished.value


class _TorchExchange(PendingExchange):
    def __init__(self, works, sent, received):
        # The sent tensors are held until the wait: the ring drops its own references to them
        # (the backward's dk, dv) while NCCL may still be reading them on its stream.
        self.works, self.sent, self.received = works, sent, received

    def wait(self):
        for work in self.works:
            work.wait()  # on NCCL: torch's current stream waits for the transfer, the host does not
        self.sent = None
        return self.received


class TorchDistributedCommunicator(RingCommunicator):
    """The ring of a torch.distributed process group (NCCL for CUDA tensors, gloo for CPU
    ones): ``batch_isend_irecv`` of point-to-point sends to the next rank and receives from
    the previous one. ``group`` None is the default group; it must be initialised."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedCommunicator needs torch.distributed initialised "
                               "(torch.distributed.init_process_group, e.g. under torchrun)")
        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        self.ranks = (rank,)

    def exchange(self, rank, tensors):
        dist = self._dist
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        following, preceding = (rank + 1) % self.world_size, (rank - 1) % self.world_size
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=following) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=preceding) for t in received]
        return _TorchExchange(dist.batch_isend_irecv(ops), tuple(tensors), tuple(received))

    def run(self, programs):
        if len(programs) != 1:
            raise ValueError(f"a torch.distributed process runs one rank's program, got {len(programs)}")
        return [_run_blocking(programs[0])]


class _SimulatedExchange(PendingExchange):
    def __init__(self, ring, rank, serial, expected):
        self.ring, self.rank, self.serial, self.expected = ring, rank, serial, expected

    def ready(self) -> bool:
        return (self.rank, self.serial) in self.ring._mailbox

    def wait(self):
        received = self.ring._mailbox.pop((self.rank, self.serial))
        got = [(tuple(t.shape), t.dtype) for t in received]
        if got != self.expected:  # a real ring would receive garbage (or hang) here
            raise ValueError(f"simulated rank {self.rank} expected tensors {self.expected} from rank "
                             f"{(self.rank - 1) % self.ring.world_size}, which sent {got}: every rank "
                             f"must pass shards of the same shapes and dtypes")
        return received


class SimulatedRing(RingCommunicator):
    """W simulated ranks in one process: every rank's program runs here, in lock step, and an
    exchange hands the sent tensors themselves to the next rank.

    Pass it as ``communicator`` with per-rank lists of shards::

        outs = ring_attention([q0, q1, q2], [k0, k1, k2], [v0, v1, v2], communicator=SimulatedRing(3))
    """

    def __init__(self, world_size: int):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self._mailbox = {}
        self._sent = [0] * world_size

    def exchange(self, rank, tensors):
        serial = self._sent[rank]
        self._sent[rank] += 1
        self._mailbox[((rank + 1) % self.world_size, serial)] = tuple(tensors)
        return _SimulatedExchange(self, rank, serial, [(tuple(t.shape), t.dtype) for t in tensors])

    def run(self, programs):
        if len(programs) != self.world_size:
            raise ValueError(f"a SimulatedRing({self.world_size}) runs {self.world_size} programs, got {len(programs)}")
        self._mailbox.clear()
        self._sent = [0] * self.world_size
        results = [None] * self.world_size
        waiting = {}  # rank -> the exchange its program waits for
        for rank, program in enumerate(programs):
            self._advance(rank, program, lambda p=program: next(p), waiting, results)
        while waiting:
            ready = [rank for rank, pending in waiting.items() if pending.ready()]
            if not ready:
                raise RuntimeError(f"simulated ring deadlock: ranks {sorted(waiting)} wait for exchanges "
                                   f"no rank has started")
            for rank in ready:
                received = waiting.pop(rank).wait()
                self._advance(rank, programs[rank], lambda p=programs[rank]: p.send(received), waiting, results)
        if self._mailbox:
            raise RuntimeError(f"simulated ring: {len(self._mailbox)} exchanges were sent and never received")
        return results

    @staticmethod
    def _advance(rank, program, resume, waiting, results):
        try:
            waiting[rank] = resume()
        except StopIteration as finished:
            results[rank] = finished.value


# ---- the algorithm, one rank's steps -------------------------------------------------------


class _Options(NamedTuple):
    causal: bool
    scale: Optional[float]
    layout: str
    local: LocalAttention


def _accumulator_dtype(dtype):
    """Running sums are float32 (float64 for float64 inputs): merging W low-precision partial
    results in their own dtype would round W times."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_program(comm: RingCommunicator, rank: int, q, k, v, options: _Options):
    """Rank ``rank``'s forward: yields where it waits for K/V; returns (o, l, m) of its queries."""
    world_size, n_q, n_k = comm.world_size, q.shape[-2], k.shape[-2]
    acc = _accumulator_dtype(q.dtype)
    o = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)
    l = torch.zeros(q.shape[:-1], dtype=acc, device=q.device)
    m = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)  # no keys yet: the empty result
    for step in range(world_size):
        source = (rank - step) % world_size  # whose K/V shard this rank holds now
        # -- start passing the shard on before computing on it, so the transfer overlaps --
        pending = comm.exchange(rank, (k, v)) if step < world_size - 1 else None
        for block in _blocks(rank, source, world_size, options.layout, n_q, n_k, options.causal):
            rows = slice(block.q_start, block.q_stop)
            part_o, part_l, part_m = options.local.forward(
                q[..., rows, :], k[..., :block.k_stop, :], v[..., :block.k_stop, :], block.causal, options.scale)
            o[..., rows, :], l[..., rows], m[..., rows] = merge(
                o[..., rows, :], l[..., rows], m[..., rows], part_o.to(acc), part_l.to(acc), part_m.to(acc))
        if pending is not None:
            k, v = yield pending
    return o.to(q.dtype), l, m


def _backward_program(comm: RingCommunicator, rank: int, do, q, k, v, o, l, m, options: _Options):
    """Rank ``rank``'s backward: returns (dq, dk, dv) of its own shards.

    dk, dv of the shard held at step t are summed on the way: the partial sum arrives from the
    previous rank (which held the shard at step t - 1), this rank adds its blocks' terms and
    sends it on; after step W - 1 the next rank is the shard's owner.
    """
    world_size, n_q, n_k = comm.world_size, q.shape[-2], k.shape[-2]
    acc = _accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    rows_stats = {}  # the kernels read l and m C-contiguous: a row range's copies, made once
    pending_grads = None
    for step in range(world_size):
        source = (rank - step) % world_size
        pending_kv = comm.exchange(rank, (k, v)) if step < world_size - 1 else None
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for block in _blocks(rank, source, world_size, options.layout, n_q, n_k, options.causal):
            rows, keys = slice(block.q_start, block.q_stop), slice(0, block.k_stop)
            rows_key = (block.q_start, block.q_stop)
            if rows_key not in rows_stats:
                rows_stats[rows_key] = (l[..., rows].contiguous(), m[..., rows].contiguous())
            block_dq, block_dk, block_dv = options.local.backward(
                do[..., rows, :], q[..., rows, :], k[..., keys, :], v[..., keys, :], o[..., rows, :],
                *rows_stats[rows_key], block.causal, options.scale)
            dq[..., rows, :] += block_dq
            dk[..., keys, :] += block_dk
            dv[..., keys, :] += block_dv
        if pending_grads is not None:
            # dk, dv are this step's own tensors (not sent yet): adding in place is safe.
            earlier_dk, earlier_dv = yield pending_grads
            dk += earlier_dk
            dv += earlier_dv
        if world_size > 1:
            pending_grads = comm.exchange(rank, (dk, dv))
        if pending_kv is not None:
            k, v = yield pending_kv
    if world_size > 1:
        dk, dv = yield pending_grads  # the owner's shard, with every rank's terms
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """The ring over the ranks this process runs: inputs q_0.., k_0.., v_0.. (one of each under
    torch.distributed, W in a simulation), outputs o_0.., l_0.., m_0..."""

    @staticmethod
    def forward(ctx, comm, options, *shards):
        n = len(comm.ranks)
        qs, ks, vs = shards[:n], shards[n:2 * n], shards[2 * n:]
        programs = [_forward_program(comm, rank, q, k, v, options) for rank, q, k, v in zip(comm.ranks, qs, ks, vs)]
        os_, ls, ms = zip(*comm.run(programs))
        ctx.comm, ctx.options = comm, options
        ctx.save_for_backward(*qs, *ks, *vs, *os_, *ls, *ms)
        ctx.mark_non_differentiable(*ls, *ms)  # statistics, returned for inspection
        return (*os_, *ls, *ms)

    @staticmethod
    def backward(ctx, *grads):
        comm, options = ctx.comm, ctx.options
        n = len(comm.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, os_, ls, ms = (saved[i * n:(i + 1) * n] for i in range(6))
        # Every rank runs the ring even when its o took no part in the loss (autograd then
        # hands a zero gradient): the other ranks' K/V gradients pass through it.
        programs = [_backward_program(comm, rank, do, q, k, v, o, l, m, options)
                    for rank, do, q, k, v, o, l, m in zip(comm.ranks, grads[:n], qs, ks, vs, os_, ls, ms)]
        dqs, dks, dvs = zip(*comm.run(programs))
        return (None, None, *dqs, *dks, *dvs)


# ---- the public function -------------------------------------------------------------------


def _describe(t) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _check_shards(rank_label, q, k, v, causal, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}{rank_label} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}{rank_label} must be (B, H, N_local, d), got {_describe(t)}")
    given = f"q{rank_label} {_describe(q)}, k{rank_label} {_describe(k)}, v{rank_label} {_describe(v)}"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must share one dtype and device, got {given}")
    (b, hq, n_q, d), (bk, hk, n_k, dk), (bv, hv, n_v, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv) or hk != hv or hk == 0 or hq % hk or d != dk or n_k != n_v:
        raise ValueError("q (B, Hq, N_local, d), k (B, Hk, N_local, d) and v (B, Hk, N_local, dv) must "
                         f"share B, k and v one Hk dividing Hq, q and k one d, k and v one N_local; got {given}")
    if causal and n_q != n_k:
        raise ValueError(f"causal ring attention needs each rank's query and key shards to cover the same "
                         f"positions (one N_local), got {given}")
    if causal and layout == "zigzag" and n_q % 2:
        raise ValueError(f"the zigzag layout stores two equal chunks per rank: N_local must be even, got {given}")


def ring_attention(q, k, v, group=None, causal: bool = False, scale: Optional[float] = None,
                   layout: str = "contiguous", communicator: Optional[RingCommunicator] = None,
                   return_stats: bool = False, local_attention: Optional[LocalAttention] = None):
    """Exact attention over a sequence sharded across the ranks of a ring, differentiable.

    Every rank calls it with its own shards; the result on each rank is the attention of its
    queries over the keys of the whole sequence (every rank's k and v).

    Args:
        q: (B, Hq, N_local, d), k: (B, Hk, N_local, d), v: (B, Hk, N_local, dv): this rank's
            shards, positions as ``layout`` places them (:func:`shard_sequence` cuts a whole
            sequence). Hk divides Hq (grouped-query attention). One dtype and device; with the
            default local attention CUDA tensors in float16, bfloat16 or float32, d and dv
            multiples of 8 up to 256. Every rank passes the same shapes. Non-causal calls may
            have query and key shards of different lengths.
        group: the torch.distributed process group of the ring (None: the default group).
        causal: causal over the whole sequence (query position i sees key positions <= i).
        scale: multiplies q k^T; None means 1 / sqrt(d).
        layout: ``"contiguous"`` (rank r holds positions [r N_local, (r + 1) N_local)) or
            ``"zigzag"`` (the sequence in 2W chunks, rank r holds chunks r and 2W - 1 - r
            concatenated: causal work is balanced; N_local even). Non-causal attention gives
            the same per-rank result in either layout.
        communicator: a :class:`RingCommunicator` instead of ``group``;
            :class:`SimulatedRing` runs all ranks in this process, and then q, k and v are
            sequences of W shards and the result a list of W results.
        return_stats: also return the statistics l, m (B, Hq, N_local) over the whole
            sequence (float32; float64 for float64 inputs), not differentiable.
        local_attention: the attention of one block (:class:`LocalAttention`);
            defaults to cuflash's kernels (:data:`CUFLASH_LOCAL`).

    Returns:
        o (B, Hq, N_local, dv) in q's dtype, or ``AttentionOutput(o, l, m)`` with
        ``return_stats``; a list of those with a :class:`SimulatedRing`.

    K/V shards are sent as contiguous tensors: a non-contiguous k or v is copied once. The
    backward is itself a ring (every rank must backpropagate through its output, as with any
    collective) and is not differentiable again.

    Example (under ``torchrun --nproc_per_node=4``, NCCL initialised, one GPU per rank)::

        q, k, v = (shard_sequence(x, 4, "zigzag")[rank] for x in (q_all, k_all, v_all))
        o = ring_attention(q, k, v, causal=True, layout="zigzag")   # o: this rank's positions
    """
    _check_layout(layout)
    if communicator is None:
        communicator = TorchDistributedCommunicator(group)
    elif group is not None:
        raise ValueError("pass either group (a torch.distributed ring) or communicator, not both")
    if not isinstance(communicator, RingCommunicator):
        raise TypeError(f"communicator must be a cuflash.distributed.RingCommunicator, got {type(communicator).__name__}")
    causal = bool(causal)
    scale = None if scale is None else float(scale)
    options = _Options(causal, scale, layout, CUFLASH_LOCAL if local_attention is None else local_attention)

    n = len(communicator.ranks)
    per_rank = not isinstance(q, torch.Tensor)
    if per_rank:
        qs, ks, vs = (list(x) if isinstance(x, (list, tuple)) else x for x in (q, k, v))
        if not all(isinstance(x, list) and len(x) == n for x in (qs, ks, vs)):
            raise ValueError(f"this communicator runs {n} ranks here: q, k and v must be sequences of {n} "
                             f"shards each, got " + ", ".join(
                                 f"{name} {type(x).__name__}" + (f" of {len(x)}" if isinstance(x, list) else "")
                                 for name, x in (("q", qs), ("k", ks), ("v", vs))))
        labels = [f"[{rank}]" for rank in communicator.ranks]
    else:
        if n != 1:
            raise ValueError(f"this communicator runs {n} ranks here: pass q, k and v as sequences of {n} "
                             f"shards, got a single tensor q")
        qs, ks, vs, labels = [q], [k], [v], [""]
    for label, q_r, k_r, v_r in zip(labels, qs, ks, vs):
        _check_shards(label, q_r, k_r, v_r, causal, layout)
    if per_rank:
        for name, shards in (("q", qs), ("k", ks), ("v", vs)):
            kinds = {(tuple(t.shape), t.dtype) for t in shards}
            if len(kinds) != 1:
                raise ValueError(f"every rank must pass {name} of one shape and dtype, got "
                                 + ", ".join(f"{name}[{r}] {_describe(t)}" for r, t in enumerate(shards)))

    # The ring sends K/V shards whole: NCCL needs them contiguous.
    ks = [t.contiguous() for t in ks]
    vs = [t.contiguous() for t in vs]
    outputs = _RingAttention.apply(communicator, options, *qs, *ks, *vs)
    results = [AttentionOutput(*outputs[i::n]) if return_stats else outputs[i] for i in range(n)]
    return results if per_rank else results[0]
