"""The e2e table: forward + backward through each adapter as a model calls it, host time
included.

Shapes (SHAPES): GPT-2 small and three more of issue 14, and a grouped-query model shape (32
query heads, 8 key-value heads, head dim 128) at sequence lengths 2048-8192 with ~16k tokens a
batch; bf16, causal. Backends: cuflash.torch.attention through autograd against SDPA (torch's
own backend choice, and pinned to its flash and cuDNN backends); under jax.jit, the gradient of
cuflash.jax.attention against jax.nn.dot_product_attention's cuDNN and XLA paths.

Timing (time_loops): after warm-up calls (compilation, autotuning, allocator growth), ROUNDS
loops of back-to-back calls, each loop about ROUND_TARGET_MS of work, the calls rotating among
input sets larger than twice L2; a loop starts from a drained GPU queue and is timed whole, so
a call whose host work outlasts its GPU work shows it. torch: CUDA events on the current stream
around the loop; JAX: wall time to jax.block_until_ready of the last output. Alongside, the
CPU time spent issuing the loop. Medians over the rounds, per call.

Importing this module needs neither a GPU, CuPy, PyTorch nor JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Callable, Optional

from . import common, host
from .common import DASH, Footnotes

CAUSAL = True
WARMUP = 3
ROUNDS = 5
ROUND_TARGET_MS = 30.0
MIN_CALLS, MAX_CALLS = 3, 50


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    hdim: int
    note: str = ""

    @property
    def label(self) -> str:
        dims = f"{self.batch}x{self.heads}x{self.seq}x{self.hdim}"
        if self.kv_heads != self.heads:
            dims += f" kv {self.kv_heads}"
        return f"{dims} ({self.note})" if self.note else dims

    @property
    def dims(self) -> tuple:
        return (self.batch, self.heads, self.seq, self.hdim)


SHAPES = (
    Shape(8, 12, 12, 1024, 64, "GPT-2 small"),
    Shape(32, 12, 12, 256, 64),
    Shape(4, 32, 32, 2048, 128),
    Shape(1, 32, 32, 8192, 128),
    Shape(8, 32, 8, 2048, 128, "GQA"),
    Shape(4, 32, 8, 4096, 128, "GQA"),
    Shape(2, 32, 8, 8192, 128, "GQA"),
)
TORCH_BACKENDS = ("cuflash.torch", "sdpa", "sdpa_flash", "sdpa_cudnn")
JAX_BACKENDS = ("cuflash.jax", "jax_cudnn", "jax_xla")
CUFLASH = {"torch": "cuflash.torch", "jax": "cuflash.jax"}
LABELS = {"cuflash.torch": "cuflash", "cuflash.jax": "cuflash", "sdpa": "sdpa",
          "sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "jax_cudnn": "cudnn", "jax_xla": "xla"}


def count_steps(args=None) -> int:
    return len(SHAPES) * (len(TORCH_BACKENDS) + len(JAX_BACKENDS))


def variant_shapes() -> set:
    """(dtype, head dim, causal) of every cuflash kernel the table launches."""
    return {("bfloat16", s.hdim, CAUSAL) for s in SHAPES}


# ---- timing ----------------------------------------------------------------------------------


class CudaEvents:
    """torch: CUDA events on the current stream around a loop."""

    def __init__(self, torch):
        self.torch = torch

    def drain(self, out) -> None:
        self.torch.cuda.synchronize()

    def start(self) -> None:
        self.torch.cuda.synchronize()
        self.begin = self.torch.cuda.Event(enable_timing=True)
        self.begin.record()

    def stop(self, out) -> float:
        end = self.torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.begin.elapsed_time(end)


class WallClock:
    """JAX: wall time from a drained queue to the last output being ready."""

    def __init__(self, block: Callable, clock: Callable[[], float] = time.perf_counter):
        self.block, self.clock = block, clock

    def drain(self, out) -> None:
        self.block(out)

    def start(self) -> None:  # the previous stop (or drain) left the queue empty
        self.begin = self.clock()

    def stop(self, out) -> float:
        self.block(out)
        return (self.clock() - self.begin) * 1e3


def time_loops(fn: Callable, input_sets: list, stopwatch, rounds: int = ROUNDS,
               warmup: int = WARMUP, clock: Callable[[], float] = time.perf_counter) -> dict:
    """{"ms", "host_us", "calls"}: medians over `rounds` loops of back-to-back calls
    fn(*input_sets[i % n]) of the GPU time (stopwatch) and the CPU time issuing them, per call.
    A loop has as many calls as fill ROUND_TARGET_MS by a one-call estimate, within
    [MIN_CALLS, MAX_CALLS]."""
    n = len(input_sets)
    out = None
    for i in range(warmup):
        out = fn(*input_sets[i % n])
    stopwatch.drain(out)
    position = [warmup]

    def loop(calls: int) -> tuple:
        stopwatch.start()
        began = clock()
        result = None
        for _ in range(calls):
            result = fn(*input_sets[position[0] % n])
            position[0] += 1
        issued = clock() - began
        return stopwatch.stop(result) / calls, issued / calls * 1e6

    estimate, _ = loop(1)
    calls = MAX_CALLS if estimate <= 0 else int(min(MAX_CALLS, max(
        MIN_CALLS, math.ceil(ROUND_TARGET_MS / estimate))))
    loops = [loop(calls) for _ in range(rounds)]
    return {"ms": statistics.median(ms for ms, _ in loops),
            "host_us": statistics.median(us for _, us in loops), "calls": calls}


# ---- backends --------------------------------------------------------------------------------


def torch_attend(env, name: str, gqa: bool) -> tuple:
    """(attend(q, k, v), context) of a torch backend."""
    torch = env.torch
    if name == "cuflash.torch":
        return host.cuflash_torch_attend(CAUSAL), contextlib.nullcontext
    attend = host.sdpa_attend(torch, CAUSAL, gqa)
    if name == "sdpa":
        return attend, contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .speed import SDPA_BACKENDS

    which = getattr(SDPBackend, SDPA_BACKENDS[name])
    return attend, lambda: sdpa_kernel(which)


def input_set_count(env, shape: Shape) -> int:
    """bf16 (q, k, v, dO) sets to rotate among: together more than twice L2."""
    kv = (shape.batch, shape.kv_heads, shape.seq, shape.hdim)
    return common.num_input_sets(2 * (2 * math.prod(shape.dims) + 2 * math.prod(kv)), env.l2_bytes)


def torch_sets(env, shape: Shape) -> list:
    """(q, k, v, dO) sets, q, k, v leaves that require grad."""
    torch = env.torch
    kv = (shape.batch, shape.kv_heads, shape.seq, shape.hdim)
    sets = []
    for _ in range(input_set_count(env, shape)):
        q, do = (torch.randn(shape.dims, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sets.append(tuple(x.requires_grad_() for x in (q, k, v)) + (do,))
    return sets


def run_torch(env, name: str, shape: Shape, sets: list) -> dict:
    torch = env.torch
    attend, context = torch_attend(env, name, shape.kv_heads != shape.heads)

    def step(q, k, v, do):
        return torch.autograd.grad(attend(q, k, v), (q, k, v), do)

    with context():
        return time_loops(step, sets, CudaEvents(torch))


def jax_sets(jax, env, shape: Shape, layout: str) -> list:
    return [host.jax_inputs(jax, shape.dims, shape.kv_heads, layout, seed)
            for seed in range(input_set_count(env, shape))]


def run_jax(jax, env, name: str, shape: Shape, sets_of: Callable) -> dict:
    prefix = {"cuflash.jax": "jax", "jax_cudnn": "jax_cudnn", "jax_xla": "jax_xla"}[name]
    fn, layout = host.jax_functions(jax, CAUSAL)[f"{prefix}_grad"]
    return time_loops(fn, sets_of(layout), WallClock(jax.block_until_ready))


# ---- the sweep -------------------------------------------------------------------------------


def _failed(env, exc) -> dict:
    return {"ms": None, "host_us": None, "calls": 0,
            "status": "oom" if common.is_oom(env, exc) else "error",
            "error": common.first_line(exc)}


def _unavailable(reason: str) -> dict:
    return {"ms": None, "host_us": None, "calls": 0, "status": "unavailable", "error": reason}


def _measure(env, progress, label: str, run: Callable) -> dict:
    progress.start(label)
    try:
        entry = dict(run(), status="ok", error=None)
    except Exception as exc:
        entry = _failed(env, exc)
    progress.advance()
    if entry["ms"] is not None:
        progress.note(f"{label}: {entry['ms']:8.3f} ms, {entry['host_us']:7.1f} us host")
    else:
        progress.note(f"{label}: {entry['status']}: {entry['error']}")
    return entry


def run_e2e(env, args=None, progress=None, shapes=SHAPES) -> list:
    """One record per shape: {"shape": {...}, "label", "backends": {name: entry}}."""
    progress = common.as_progress(progress)
    records = []
    jax, jax_reason = (None, None)
    for shape in shapes:
        record = {"shape": dataclasses.asdict(shape), "label": shape.label, "backends": {}}
        backends = record["backends"]
        if env.torch is None:
            backends.update({n: _unavailable(env.torch_reason) for n in TORCH_BACKENDS})
            progress.advance(len(TORCH_BACKENDS))
        else:
            try:
                sets = torch_sets(env, shape)
            except Exception as exc:
                sets, failed = None, _failed(env, exc)
            for name in TORCH_BACKENDS:
                if sets is None:
                    backends[name] = dict(failed)
                    progress.advance()
                    continue
                backends[name] = _measure(env, progress, f"e2e {shape.label} {name}",
                                          lambda: run_torch(env, name, shape, sets))
            del sets
            env.free_memory()
        if jax is None and jax_reason is None:
            jax, jax_reason = host.load_jax()
        if jax is None:
            backends.update({n: _unavailable(jax_reason) for n in JAX_BACKENDS})
            progress.advance(len(JAX_BACKENDS))
        else:
            cache = {}

            def sets_of(layout):
                if layout not in cache:
                    cache[layout] = jax_sets(jax, env, shape, layout)
                return cache[layout]

            for name in JAX_BACKENDS:
                backends[name] = _measure(env, progress, f"e2e {shape.label} {name}",
                                          lambda: run_jax(jax, env, name, shape, sets_of))
            cache.clear()
        records.append(record)
    return records


def cuflash_failures(records: list) -> list:
    return [(f"e2e {r['label']}: {name}", e["error"]) for r in records
            for name, e in r["backends"].items()
            if name in CUFLASH.values() and e["status"] in ("error", "oom")]


# ---- the tables ------------------------------------------------------------------------------


def _cell(entry: Optional[dict], notes: Footnotes, name: str, key: str = "ms") -> str:
    if entry is None:
        return DASH
    if entry.get(key) is not None:
        return f"{entry[key]:.3f}" if key == "ms" else f"{entry[key]:.0f}"
    if entry["status"] == "unavailable":
        return f"{DASH} {notes.mark(str(entry['error']))}"
    what = "FAILED" if name in CUFLASH.values() else ("OOM" if entry["status"] == "oom" else DASH)
    return f"{what} {notes.mark(name + ': ' + str(entry['error']))}"


def _ratio(mine: Optional[dict], theirs: Optional[dict]) -> str:
    if not mine or not theirs or mine.get("ms") is None or theirs.get("ms") is None:
        return DASH
    return f"{theirs['ms'] / mine['ms']:.2f}x"


def format_e2e(records: list, notes: Footnotes, tablefmt: str = "github",
               wide: bool = False) -> str:

    blocks = []
    for framework, names, what in (
            ("torch", TORCH_BACKENDS, "PyTorch, forward + backward through autograd"),
            ("jax", JAX_BACKENDS, "JAX, jax.jit(jax.grad(...))")):
        mine = CUFLASH[framework]
        peers = [n for n in names if n != mine]
        headers = ["shape (B x H x N x d)", "cuflash ms", "host us"]
        for peer in peers:
            headers += [f"{LABELS[peer]} ms", f"vs {LABELS[peer]}"]
            if wide:
                headers.append(f"{LABELS[peer]} host us")
        rows = []
        for r in records:
            b = r["backends"]
            row = [r["label"], _cell(b.get(mine), notes, mine),
                   _cell(b.get(mine), notes, mine, "host_us")]
            for peer in peers:
                row += [_cell(b.get(peer), notes, peer), _ratio(b.get(mine), b.get(peer))]
                if wide:
                    row.append(_cell(b.get(peer), notes, peer, "host_us"))
            rows.append(row)
        title = f"e2e: {what}, bfloat16, causal"
        blocks.append(common.wrap(title) + "\n\n" + common.table(
            rows, headers, tablefmt, colalign=("left",) + ("right",) * (len(headers) - 1)))
    caption = (f"ms: time of one forward + backward, the median of {ROUNDS} loops of "
               f"{MIN_CALLS}-{MAX_CALLS} back-to-back calls (about {ROUND_TARGET_MS:g} ms each) "
               "timed whole from a drained GPU queue, so host time that the GPU waits for is "
               "counted: CUDA events for torch, wall time to jax.block_until_ready for JAX. host "
               "us: CPU time issuing one call. vs X: X's time / cuflash's (cuflash's speed as a "
               "multiple of X's). torch: cuflash.torch.attention(q, k, v, causal=True) and SDPA "
               "(is_causal=True, enable_gqa for grouped heads), then torch.autograd.grad(out, (q, "
               "k, v), dO); sdpa: torch's own backend choice; flash, cudnn: SDPA pinned to that "
               "backend. JAX: the gradient of sum(o * dO) over q, k, v of cuflash.jax.attention "
               "on (B, H, N, d) and of jax.nn.dot_product_attention(implementation='cudnn' / "
               "'xla') on (B, N, H, d). kv 8: grouped-query attention, 8 key-value heads.")
    if not wide:
        caption += " --wide adds each peer's host us."
    return "\n\n".join(blocks) + "\n\n" + "\n".join([common.wrap(caption)] + notes.lines())
