"""A soak: cuflash under a server's load for a fixed time, then under CUDA-graph replay.

    python scripts/soak.py [--seconds 120] [--threads 4] [--out DIR] [--seed 0] [--check-every 8]

Threads, each on its own non-blocking CuPy stream, call the public API (cuflash.attention and
attention_backward) over a stream of a few hundred distinct signatures (:func:`signatures`):
training shapes forward and backward (grouped heads, causal, windows, q and k of other
lengths), decoding steps against a dense cache whose filled length grows by one each step (a
new signature each), paged decoding whose lengths, in device memory, grow call by call, and
packed batches (varlen) of lengths from 0. Every input is new each call, from CuPy's pool.
Every ``--check-every``-th call of a thread is checked against the float64 reference with the
error rule of tests/gpu_util.py: training calls whole where the problem is small, else the
forward's first rows of the first head and last rows of the last; dense decoding and packed
batches whole (gradients too); paged decoding for its first and last sequence.

A sampler reads, every SAMPLE_SECONDS: CuPy's pool (bytes in use and held), the device's used
memory (cudaMemGetInfo), the process's resident host memory, and the plan caches' sizes. After
warm-up (every signature called once, and at least WARMUP_FRACTION of the threaded phase),
memory is *flat* when the largest sample of the last third of the samples is within
FLAT_RATIO of the first third's, plus FLAT_SLACK_BYTES (the pool rounds and splits blocks), and
the plan caches do not grow at all. A leak is judged on the pool's held bytes, the device's used
memory, host RSS and the plan caches; the pool's bytes in use (NOT_JUDGED) are reported only:
sampled at any moment they count the inputs and outputs of whatever calls the threads have in
flight then, which the shapes drawn decide, not a leak.

The last GRAPH_FRACTION of the time captures one step (a deterministic training step, a paged
decoding step and a packed forward, into out= buffers) on a stream as a CUDA graph and replays
it with new inputs written in place each time, comparing every replay bit for bit with the
same step run eagerly.

``--out DIR`` receives soak.json (the configuration, counts, errors, wrong results, every
memory sample and the verdicts) and soak.txt (the summary, printed too). Exit status 0 when
there was no error, no wrong result, no graph mismatch and memory stayed flat; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SAMPLE_SECONDS = 0.5
WARMUP_FRACTION = 0.2  # of the threaded phase, at least, before memory is judged
GRAPH_FRACTION = 0.15  # of --seconds, for the CUDA-graph phase
FLAT_RATIO = 1.05
FLAT_SLACK_BYTES = 64 * 2**20
NOT_JUDGED = ("pool used",)  # sampled metrics reported but left out of the verdict (module docstring)
MAX_RECORDED = 20  # errors and wrong results kept with their details
SMALL_BACKWARD = 256 * 256 * 16  # query x key x slices up to which a training step's gradients are checked
CHECKED_ROWS = 32  # of a larger training forward's first and last head (the first and the last rows)


class Signature(NamedTuple):
    """One call's shapes and options (two calls of one signature share a plan)."""

    kind: str  # "train" (forward + backward), "decode" (dense cache), "paged", "varlen" (forward + backward)
    dtype: str
    batch: int  # sequences (varlen: of the packed batch)
    heads: tuple  # (Hq, Hk)
    nq: int  # queries a head (varlen: 0)
    nk: int  # keys: train / decode the key length, paged the capacity (max_pages x page_size)
    d: int
    causal: bool = False
    window: Optional[tuple] = None
    page_size: int = 0  # paged only
    lengths: tuple = ()  # varlen: ((queries, keys), ...) a sequence


TRAIN_HEADS = ((8, 8), (8, 2), (16, 4), (12, 1), (4, 4))
DECODE_HEADS = ((32, 8), (8, 1), (16, 16))


def signatures(seed: int = 0, train: int = 120, decode_steps: int = 50, paged: int = 30, varlen: int = 60) -> list:
    """The soak's distinct signatures, the same for a seed: ``train`` training shapes,
    ``decode_steps`` steps of each of two dense-cache decoding streams, ``paged`` paged
    decoding shapes and ``varlen`` packed batches."""
    rng = np.random.default_rng(seed)
    found = {}

    def add(signature):
        found.setdefault(signature, None)

    while sum(s.kind == "train" for s in found) < train:
        n = int(rng.choice((64, 128, 200, 256, 333, 512, 777, 1024, 2048)))
        nq = n if rng.random() < 0.7 else int(rng.integers(1, n + 1))
        window = (int(rng.integers(16, 257)), 0) if rng.random() < 0.15 else None
        add(Signature("train", str(rng.choice(("float16", "bfloat16", "bfloat16", "float32"))),
                      int(rng.choice((1, 2, 4))), TRAIN_HEADS[rng.integers(len(TRAIN_HEADS))], nq, n,
                      int(rng.choice((64, 64, 128, 128, 96, 256))), bool(rng.random() < 0.5), window))
    for stream in range(2):  # a growing dense cache: one new key a step, a signature a step
        heads, d = DECODE_HEADS[stream], (128, 64)[stream]
        start = int(rng.integers(64, 1024))
        for step in range(decode_steps):
            add(Signature("decode", ("bfloat16", "float16")[stream], 1 + 3 * stream, heads, 1, start + step, d))
    while sum(s.kind == "paged" for s in found) < paged:
        page_size = int(rng.choice((16, 64, 256)))
        add(Signature("paged", str(rng.choice(("float16", "bfloat16"))), int(rng.choice((1, 4, 8, 16))),
                      DECODE_HEADS[rng.integers(len(DECODE_HEADS))], int(rng.choice((1, 1, 2, 4))),
                      page_size * int(rng.integers(1, 4096 // page_size + 1)), int(rng.choice((64, 128))),
                      bool(rng.random() < 0.3), page_size=page_size))
    while sum(s.kind == "varlen" for s in found) < varlen:
        num_seqs = int(rng.integers(1, 9))
        lengths = tuple((int(q), int(k)) for q, k in rng.choice((0, 1, 17, 64, 100, 255, 300), size=(num_seqs, 2)))
        add(Signature("varlen", str(rng.choice(("float16", "bfloat16", "float32"))), num_seqs,
                      TRAIN_HEADS[rng.integers(len(TRAIN_HEADS))], 0, 0, int(rng.choice((64, 128))),
                      bool(rng.random() < 0.5), lengths=lengths))
    return list(found)


def paged_lengths(step: int, batch: int, capacity: int) -> np.ndarray:
    """The lengths of a paged call: one more key each step, wrapping after the capacity, the
    sequences 37 apart; over capacity + 1 steps each takes every value in [0, capacity]."""
    return ((step + 37 * np.arange(batch)) % (capacity + 1)).astype(np.int32)


def flatness(samples: list, start: int) -> dict:
    """{metric: {first, last, flat, judged}} of ``samples`` (dicts of numbers, in time order)
    from index ``start`` on: the largest value of the first and of the last third, whether the
    last stays within FLAT_RATIO and FLAT_SLACK_BYTES of the first (plan counts: not above it),
    and whether the verdict counts it (not for NOT_JUDGED). None where fewer than three samples
    follow ``start``."""
    judged = samples[start:]
    if len(judged) < 3:
        return None
    third = len(judged) // 3
    out = {}
    for metric in judged[0]:
        if metric == "t":
            continue
        first = max(s[metric] for s in judged[:third])
        last = max(s[metric] for s in judged[-third:])
        bound = first if metric.startswith("plans") else first * FLAT_RATIO + FLAT_SLACK_BYTES
        out[metric] = {"first": first, "last": last, "flat": last <= bound, "judged": metric not in NOT_JUDGED}
    return out


def memory_flat(flat) -> bool:
    """The memory verdict: judged (``flatness``) and every judged metric flat."""
    return bool(flat) and all(v["flat"] for v in flat.values() if v["judged"])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="the whole soak, graph phase included")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("soak-logs"), help="folder for soak.json and soak.txt")
    parser.add_argument("--seed", type=int, default=0, help="the signatures' and the inputs' seed")
    parser.add_argument("--check-every", type=int, default=8, metavar="N",
                        help="check every N-th call of a thread against the reference")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.threads < 1 or args.check_every < 1:
        parser.error(f"--seconds must be > 0, --threads and --check-every >= 1; got {args.seconds}, "
                     f"{args.threads}, {args.check_every}")
    return args


# ---- on the GPU -----------------------------------------------------------------------------


def _random(generator, shape, dtype):
    """Normal values in ``dtype`` on the current stream."""
    from gpu_util import np_dtype

    return generator.standard_normal(shape, dtype=np.float32).astype(np_dtype(dtype))


def _host(x):
    return np.asarray(x.get())


class Call:
    """One call of a signature on fresh inputs: ``run()`` launches it, ``check()`` compares
    its results with the reference (raising AssertionError)."""

    def __init__(self, signature: Signature, generator, step: int):
        import cupy

        self.s, s = signature, signature
        hq, hk = s.heads
        if s.kind == "varlen":
            lengths_q, lengths_k = zip(*s.lengths)
            self.cu = [np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k)]
            self.q = _random(generator, (hq, int(self.cu[0][-1]), s.d), s.dtype)
            self.k, self.v = (_random(generator, (hk, int(self.cu[1][-1]), s.d), s.dtype) for _ in range(2))
            self.do = _random(generator, self.q.shape, s.dtype)
            self.packed = dict(causal=s.causal, cu_seqlens_q=cupy.asarray(self.cu[0]),
                               cu_seqlens_k=cupy.asarray(self.cu[1]), max_seqlen_q=max(lengths_q),
                               max_seqlen_k=max(lengths_k))
        elif s.kind == "paged":
            max_pages = s.nk // s.page_size
            num_pages = s.batch * max_pages + 3
            self.q = _random(generator, (s.batch, hq, s.nq, s.d), s.dtype)
            self.k, self.v = (_random(generator, (num_pages, hk, s.page_size, s.d), s.dtype) for _ in range(2))
            order = np.random.default_rng(step).permutation(num_pages)[:s.batch * max_pages]
            self.table = order.reshape(s.batch, max_pages).astype(np.int32)
            self.lengths = paged_lengths(step, s.batch, s.nk)
        else:
            self.q = _random(generator, (s.batch, hq, s.nq, s.d), s.dtype)
            self.k, self.v = (_random(generator, (s.batch, hk, s.nk, s.d), s.dtype) for _ in range(2))
            if s.kind == "train":
                self.do = _random(generator, self.q.shape, s.dtype)

    def run(self):
        import cupy

        import cuflash

        s = self.s
        if s.kind == "varlen":
            self.out = cuflash.attention(self.q, self.k, self.v, **self.packed)
            self.grads = cuflash.attention_backward(self.do, self.q, self.k, self.v, *self.out, **self.packed)
        elif s.kind == "paged":
            self.out = cuflash.attention(self.q, self.k, self.v, page_table=cupy.asarray(self.table),
                                         seqlens_k=cupy.asarray(self.lengths), causal=s.causal)
        elif s.kind == "decode":
            self.out = cuflash.attention(self.q, self.k, self.v)
        else:
            self.out = cuflash.attention(self.q, self.k, self.v, causal=s.causal, window=s.window)
            self.grads = cuflash.attention_backward(self.do, self.q, self.k, self.v, *self.out, causal=s.causal,
                                                    window=s.window)

    def check(self) -> str:
        """Compare with the reference; returns what was compared."""
        import gpu_util
        import varlen_util

        from cuflash import reference as ref

        s = self.s
        q, k, v = (_host(x) for x in (self.q, self.k, self.v))
        if s.kind == "varlen":
            varlen_util.check_forward(self.out, q, k, v, *self.cu, dtype=s.dtype, causal=s.causal)
            varlen_util.check_backward(self.grads, _host(self.do), q, k, v, *self.cu, dtype=s.dtype, causal=s.causal)
            return "forward, gradients"
        if s.kind == "paged":  # the first and the last sequence
            for b in {0, s.batch - 1}:
                k_b, v_b, allowed = self._gathered(b, k, v)
                out = tuple(x[b:b + 1] for x in self.out)
                gpu_util.check_forward(out, q[b:b + 1], k_b, v_b, causal=False, dtype=s.dtype, mask=allowed)
            return "forward"
        if s.kind == "decode":
            gpu_util.check_forward(self.out, q, k, v, causal=False, dtype=s.dtype)
            return "forward"
        mask = ref.element_mask(s.nq, s.nk, window=s.window) if s.window else None
        slices = s.batch * s.heads[0]
        if s.nq * s.nk * slices <= SMALL_BACKWARD:
            gpu_util.check_forward(self.out, q, k, v, causal=s.causal, dtype=s.dtype, mask=mask)
            gpu_util.check_backward(self.grads, _host(self.do), q, k, v, causal=s.causal, dtype=s.dtype, mask=mask)
            return "forward, gradients"
        # The first rows of the first head and the last rows of the last: rows are independent
        # in the forward, so their reference against every key (with their rows of the causal
        # and window mask) is exact.
        allowed = ref.allowed_keys(s.nq, s.nk, causal=s.causal, mask=mask)
        group = s.heads[0] // s.heads[1]
        for b, h, rows in ((0, 0, slice(0, CHECKED_ROWS)), (s.batch - 1, s.heads[0] - 1, slice(-CHECKED_ROWS, None))):
            out = tuple(x[b, h, rows] for x in self.out)
            gpu_util.check_forward(out, q[b, h, rows], k[b, h // group], v[b, h // group], causal=False,
                                   dtype=s.dtype, mask=allowed[rows])
        return "forward rows"

    def _gathered(self, b, k_pages, v_pages):
        """Sequence b's keys and values from the paged cache as (1, Hk, capacity, d), and the
        mask (1, 1, Nq, capacity) of those its length (clamped) and causality allow."""
        from cuflash import reference as ref

        s = self.s
        # (max_pages, Hk, page_size, d) -> (Hk, max_pages * page_size, d)
        k, v = (np.swapaxes(pages[self.table[b]], 0, 1).reshape(1, s.heads[1], s.nk, s.d)
                for pages in (k_pages, v_pages))
        n = int(np.clip(self.lengths[b], 0, s.nk))
        allowed = np.zeros((1, 1, s.nq, s.nk), bool)
        allowed[0, 0, :, :n] = ref.allowed_keys(s.nq, n, causal=s.causal)
        return k, v, allowed


class Tally:
    """What the threads report, under one lock."""

    def __init__(self, signatures):
        self.lock = threading.Lock()
        self.unseen = set(signatures)
        self.warm_at = None  # when the last signature was first called
        self.calls = {}
        self.checks = {}
        self.errors, self.wrong = [], []
        self.error_count = self.wrong_count = 0

    def called(self, signature, now):
        with self.lock:
            self.calls[signature.kind] = self.calls.get(signature.kind, 0) + 1
            if signature in self.unseen:
                self.unseen.discard(signature)
                if not self.unseen:
                    self.warm_at = now

    def checked(self, signature, what):
        with self.lock:
            key = f"{signature.kind}: {what}"
            self.checks[key] = self.checks.get(key, 0) + 1

    def failed(self, what, exc, wrong: bool = False):
        """An error (or, ``wrong``, a result the reference check refused) of ``what`` (a
        Signature or a phase's name); the first MAX_RECORDED of each are kept whole."""
        record = {"signature": what._asdict() if isinstance(what, Signature) else what,
                  "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)}
        with self.lock:
            records = self.wrong if wrong else self.errors
            if len(records) < MAX_RECORDED:
                records.append(record)
            if wrong:
                self.wrong_count += 1
            else:
                self.error_count += 1


def worker(offset, order, deadline, tally, seed, check_every):
    """Calls the signatures of ``order`` in turn from ``offset`` on a stream of its own until
    ``deadline``; every check_every-th call is checked."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    generator = cupy.random.default_rng(seed + offset)
    step = 0
    with stream:
        while time.perf_counter() < deadline:
            signature = order[(offset + step) % len(order)]
            step += 1
            try:
                call = Call(signature, generator, step)
                call.run()
                stream.synchronize()  # an asynchronous fault surfaces here, with its signature
            except Exception as exc:  # noqa: BLE001 - every failure is counted and the soak goes on
                tally.failed(signature, exc)
                continue
            tally.called(signature, time.perf_counter())
            if step % check_every == 0:
                try:
                    tally.checked(signature, call.check())
                except AssertionError as exc:
                    tally.failed(signature, exc, wrong=True)
                except Exception as exc:  # noqa: BLE001
                    tally.failed(signature, exc)


def _plan_counts() -> dict:
    """The plan cache's entries by kind (plans and the front ends' shortcuts to them)."""
    from cuflash import _cache

    return {f"plans {kind}": int(n) for kind, n in sorted(_cache.PLANS.kinds().items())}


def _resident_bytes() -> int:
    """The process's resident host memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def sample(start) -> dict:
    import cupy

    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"t": round(time.perf_counter() - start, 3), "pool used": int(pool.used_bytes()),
            "pool held": int(pool.total_bytes()), "device used": int(total - free), "host rss": _resident_bytes(),
            **_plan_counts()}


def sampler(samples, start, stop):
    while not stop.wait(SAMPLE_SECONDS):
        samples.append(sample(start))


# ---- CUDA graphs --------------------------------------------------------------------------------


def graph_phase(deadline, seed) -> dict:
    """Capture one step (a deterministic training step, a paged decoding step, a packed forward,
    all into out= buffers) as a graph; until ``deadline`` write new inputs in place, replay,
    and compare every output bit for bit with the same step run eagerly."""
    import cupy

    import cuflash

    stream = cupy.cuda.Stream(non_blocking=True)
    generator = cupy.random.default_rng(seed)
    train = Call(Signature("train", "bfloat16", 2, (8, 2), 300, 300, 128, True), generator, 0)
    paged = Call(Signature("paged", "float16", 4, (32, 8), 1, 1024, 128, page_size=64), generator, 0)
    packed = Call(Signature("varlen", "bfloat16", 4, (8, 2), 0, 0, 64, True,
                            lengths=((17, 30), (0, 5), (100, 100), (1, 64))), generator, 0)
    table, lengths = cupy.asarray(paged.table), cupy.asarray(paged.lengths)
    outputs = {name: tuple(cupy.empty_like(x) for x in out) for name, out in (
        ("training forward", cuflash.attention(train.q, train.k, train.v, causal=True)),
        ("training gradients", (train.q, train.k, train.v)),
        ("paged decoding", cuflash.attention(paged.q, paged.k, paged.v, page_table=table, seqlens_k=lengths)),
        ("packed forward", cuflash.attention(packed.q, packed.k, packed.v, **packed.packed)))}

    def step():
        o = outputs["training forward"]
        cuflash.attention(train.q, train.k, train.v, causal=True, out=o)
        cuflash.attention_backward(train.do, train.q, train.k, train.v, *o, causal=True, deterministic=True,
                                   out=outputs["training gradients"])
        cuflash.attention(paged.q, paged.k, paged.v, page_table=table, seqlens_k=lengths,
                          out=outputs["paged decoding"])
        cuflash.attention(packed.q, packed.k, packed.v, out=outputs["packed forward"], **packed.packed)

    def refill(replay):
        """New inputs written in place (byte copies: CuPy copies bfloat16 as bytes only)."""
        for x in (train.q, train.k, train.v, train.do, paged.q, paged.k, paged.v, packed.q, packed.k, packed.v):
            x.view(np.uint8)[...] = _random(generator, x.shape, np.dtype(x.dtype).name).view(np.uint8)
        lengths[...] = cupy.asarray(paged_lengths(97 * replay, paged.s.batch, paged.s.nk))

    replays = mismatches = 0
    cupy.cuda.Device().synchronize()  # the inputs were made on the null stream
    with stream:
        step()
        step()  # plans, kernels and the pool's blocks exist before the capture
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        while time.perf_counter() < deadline:
            refill(replays)
            graph.launch(stream)
            replayed = {name: [x.copy() for x in out] for name, out in outputs.items()}
            step()
            stream.synchronize()
            for name, out in outputs.items():  # bit for bit
                if not all(bool(cupy.array_equal(a.view(np.uint8), b.view(np.uint8)))
                           for a, b in zip(replayed[name], out)):
                    mismatches += 1
            replays += 1
    return {"replays": replays, "mismatches": mismatches, "steps": list(outputs)}


# ---- the run -------------------------------------------------------------------------------------


def _counts(counts: dict) -> str:
    """'12 (a 5, b 7)' of {name: count}."""
    return f"{sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})"


def summary_lines(result) -> list:
    """The summary soak.txt holds and main() prints."""
    lines = [f"soak: {result['seconds']:.0f} s, {result['threads']} threads, {result['signatures']} signatures, "
             f"{_counts(result['calls'])} calls",
             f"checked against the reference: {_counts(result['checks'])}",
             f"errors: {result['error_count']}; wrong results: {result['wrong_count']}"]
    if result["warm_at"] is None:
        lines.append(f"memory: not judged: {result['unseen']} signatures never called (more --seconds or threads)")
    elif result["flat"] is None:
        lines.append("memory: not judged: too few samples after warm-up")
    else:
        lines.append(f"memory after warm-up ({result['warm_at']:.0f} s; first third max -> last third max):")
        for metric, v in result["flat"].items():
            unit = (lambda x: f"{x / 2**20:.0f} MiB") if not metric.startswith("plans") else str
            verdict = ("flat" if v["flat"] else "GROWS") if v["judged"] else "(calls in flight: not judged)"
            lines.append(f"  {metric}: {unit(v['first'])} -> {unit(v['last'])} {verdict}")
    graph = result["graph"]
    lines.append(f"CUDA graph ({', '.join(graph['steps'])}): {graph['replays']} replays, "
                 f"{graph['mismatches']} mismatches against eager calls")
    lines.append(f"verdict: {'PASS' if result['passed'] else 'FAIL'}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy  # noqa: F401 - fails here, not in a thread, without CuPy's CUDA

    order = signatures(args.seed)
    np.random.default_rng(args.seed).shuffle(order)
    tally = Tally(order)
    samples, stop = [], threading.Event()
    start = time.perf_counter()
    graph_start = start + args.seconds * (1 - GRAPH_FRACTION)
    watcher = threading.Thread(target=sampler, args=(samples, start, stop), daemon=True)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(i * len(order) // args.threads, order, graph_start, tally,
                                                     args.seed, args.check_every))
               for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threaded = [s for s in samples if s["t"] <= graph_start - start]
    warm_at = None if tally.warm_at is None else max(tally.warm_at - start, WARMUP_FRACTION * (graph_start - start))
    first = next((i for i, s in enumerate(threaded) if warm_at is not None and s["t"] >= warm_at), len(threaded))
    try:
        graph = graph_phase(start + args.seconds, args.seed)
    except Exception as exc:  # noqa: BLE001 - reported, and the soak fails
        graph = {"replays": 0, "mismatches": 0, "steps": [], "error": f"{type(exc).__name__}: {exc}"}
        tally.failed("graph phase", exc)
    stop.set()
    watcher.join()
    flat = flatness(threaded, first) if warm_at is not None else None
    result = {
        "seconds": time.perf_counter() - start, "threads": args.threads, "seed": args.seed,
        "signatures": len(order), "unseen": len(tally.unseen), "warm_at": warm_at, "calls": tally.calls,
        "checks": tally.checks, "error_count": tally.error_count, "wrong_count": tally.wrong_count,
        "errors": tally.errors, "wrong": tally.wrong, "flat": flat, "graph": graph, "samples": samples,
        "peak": {metric: max(s[metric] for s in samples) for metric in samples[0] if metric != "t"} if samples else {},
    }
    result["passed"] = bool(not tally.error_count and not tally.wrong_count and not graph["mismatches"]
                            and graph["replays"] and memory_flat(flat))
    lines = summary_lines(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "soak.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for record in (tally.errors + tally.wrong)[:3]:
        print(f"first failures: {record['signature']}: {record['error']}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
