"""The host table: CPU microseconds per call of each API, with the GPU's work negligible.

At a tiny shape (HOST_SHAPE, bf16, causal) a kernel runs a few microseconds, far less than
any API spends on the host, so back-to-back calls keep the GPU queue ahead of the GPU and the
wall time of back-to-back calls, divided by their number, is the host's time per call: argument
checks, plan look-ups, allocation, launches, autograd, dispatch. The host's own speed drifts
(on one H200 machine SDPA's forward + backward took 205 us a call in a small script and 405 us
in a benchmark run minutes later), so a framework's rows are measured side by side: HOST_ROUNDS
rounds, each timing HOST_CALLS / HOST_ROUNDS calls of every row (in alternating order), after
HOST_WARMUP untimed calls of each; a row's figure is the median of its rounds.

Rows (CASES): cuflash on CuPy arrays (forward, backward), the torch adapter (forward, forward
+ backward through autograd) against SDPA with torch's own backend choice, and under jax.jit
the JAX adapter (forward, grad) against jax.nn.dot_product_attention's cuDNN and XLA paths.
Each cuflash row has its target from issue 14 (TARGETS): an absolute bound, or a bound over
its peer's time. A row whose framework is missing or whose call fails is a dash with the
reason in a footnote (for a cuflash row: FAILED, and the command exits 1).

Importing this module needs neither a GPU, CuPy, PyTorch nor JAX.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable, Optional

from . import common
from .common import DASH, Footnotes

HOST_SHAPE = (1, 1, 128, 64)  # (batch, heads, seq, head dim): microseconds of GPU work
HOST_CALLS = 2000
HOST_WARMUP = 200
HOST_ROUNDS = 10
CAUSAL = True


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # the JSON key
    api: str  # table label of the API
    call: str  # what one call does
    mode: str  # fwd | bwd | fwdbwd, as in the speed table
    framework: str  # cupy | torch | jax
    peer: Optional[str] = None  # the case it is compared to
    is_cuflash: bool = True


@dataclasses.dataclass(frozen=True)
class Target:
    """Issue 14's bound on a row: us <= limit_us, or us <= the peer's + limit_us."""
    limit_us: float
    over_peer: bool

    def label(self, peer_api: Optional[str]) -> str:
        bound = f"{self.limit_us:g} us"
        return f"<= {peer_api} + {bound}" if self.over_peer else f"<= {bound}"

    def met(self, us: Optional[float], peer_us: Optional[float]) -> Optional[bool]:
        if us is None or (self.over_peer and peer_us is None):
            return None
        return us <= self.limit_us + (peer_us if self.over_peer else 0.0)


CASES = (
    Case("cupy_fwd", "cuflash (CuPy)", "forward", "fwd", "cupy"),
    Case("cupy_bwd", "cuflash (CuPy)", "backward", "bwd", "cupy"),
    Case("torch_fwd", "cuflash.torch", "forward", "fwd", "torch", peer="sdpa_fwd"),
    Case("torch_fwdbwd", "cuflash.torch", "fwd + bwd (autograd)", "fwdbwd", "torch",
         peer="sdpa_fwdbwd"),
    Case("sdpa_fwd", "SDPA", "forward", "fwd", "torch", is_cuflash=False),
    Case("sdpa_fwdbwd", "SDPA", "fwd + bwd (autograd)", "fwdbwd", "torch", is_cuflash=False),
    Case("jax_fwd", "cuflash.jax", "jit forward", "fwd", "jax", peer="jax_cudnn_fwd"),
    Case("jax_grad", "cuflash.jax", "jit(grad)", "fwdbwd", "jax", peer="jax_cudnn_grad"),
    Case("jax_cudnn_fwd", "JAX cuDNN", "jit forward", "fwd", "jax", is_cuflash=False),
    Case("jax_cudnn_grad", "JAX cuDNN", "jit(grad)", "fwdbwd", "jax", is_cuflash=False),
    Case("jax_xla_fwd", "JAX XLA", "jit forward", "fwd", "jax", is_cuflash=False),
    Case("jax_xla_grad", "JAX XLA", "jit(grad)", "fwdbwd", "jax", is_cuflash=False),
)
CASE_BY_NAME = {c.name: c for c in CASES}
TARGETS = {  # issue 14, "Adapters as thin as the peers'"
    "cupy_fwd": Target(10, over_peer=False),
    "cupy_bwd": Target(15, over_peer=False),
    "torch_fwd": Target(25, over_peer=True),
    "torch_fwdbwd": Target(65, over_peer=True),
    "jax_fwd": Target(20, over_peer=True),
    "jax_grad": Target(20, over_peer=True),
}


def count_steps(args=None) -> int:
    return len(CASES)


def host_us(fn: Callable, sync: Callable, calls: int = HOST_CALLS, warmup: int = HOST_WARMUP,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Wall microseconds per call of `calls` back-to-back fn() after `warmup` untimed ones,
    from a drained queue to a drained queue; sync(last output) drains it."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(out)
    start = clock()
    for _ in range(calls):
        out = fn()
    sync(out)
    return (clock() - start) / calls * 1e6


# ---- the calls of each framework -----------------------------------------------------------


def cupy_calls(env) -> dict:
    """name -> (fn, sync) of the CuPy rows, on CuPy's current stream."""
    import cuflash

    q, k, v, do = (common.as_cupy(env, common.random_tensor(env, HOST_SHAPE)) for _ in range(4))
    o, l, m = cuflash.attention(q, k, v, causal=CAUSAL)
    stream = env.cupy.cuda.get_current_stream()

    def sync(_):
        stream.synchronize()

    return {"cupy_fwd": (lambda: cuflash.attention(q, k, v, causal=CAUSAL), sync),
            "cupy_bwd": (lambda: cuflash.attention_backward(do, q, k, v, o, l, m, causal=CAUSAL),
                         sync)}


def torch_attention_calls(torch, attend: Callable, shape: tuple, kv_heads: Optional[int] = None,
                          dtype=None) -> tuple:
    """(forward, forward + backward) callables of attend(q, k, v) on fresh random tensors:
    the second records the graph and runs torch.autograd.grad(out, (q, k, v), dO)."""
    dtype = dtype or torch.bfloat16
    batch, heads, seq, hdim = shape
    kv_shape = (batch, kv_heads or heads, seq, hdim)
    q, do = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(kv_shape, device="cuda", dtype=dtype) for _ in range(2))
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))

    def forward():
        return attend(q, k, v)

    def forward_backward():
        return torch.autograd.grad(attend(*leaves), leaves, do)

    return forward, forward_backward


def sdpa_attend(torch, causal: bool, gqa: bool = False) -> Callable:
    """SDPA with torch's own backend choice; enable_gqa only for grouped heads (older torch
    builds lack the argument)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    extra = {"enable_gqa": True} if gqa else {}
    return lambda q, k, v: sdpa(q, k, v, is_causal=causal, **extra)


def cuflash_torch_attend(causal: bool) -> Callable:
    import cuflash.torch

    return lambda q, k, v: cuflash.torch.attention(q, k, v, causal=causal)


def torch_calls(env) -> dict:
    torch = env.torch

    def sync(_):
        torch.cuda.synchronize()

    out = {}
    for prefix, attend in (("torch", cuflash_torch_attend(CAUSAL)),
                           ("sdpa", sdpa_attend(torch, CAUSAL))):
        forward, both = torch_attention_calls(torch, attend, HOST_SHAPE)
        out[f"{prefix}_fwd"] = (forward, sync)
        out[f"{prefix}_fwdbwd"] = (both, sync)
    return out


_JAX_STATE: Optional[tuple] = None


def load_jax():
    """(jax, None) or (None, reason). JAX is told not to take most of the GPU's memory at
    start-up (its default), since torch and CuPy share the device in this process."""
    global _JAX_STATE
    if _JAX_STATE is None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import jax

            gpus = [d for d in jax.devices() if d.platform == "gpu"]
            _JAX_STATE = (jax, None) if gpus else (None, f"JAX {jax.__version__} sees no GPU")
        except Exception as exc:
            _JAX_STATE = (None, f"JAX is not available ({common.first_line(exc)})")
    return _JAX_STATE


def jax_functions(jax, causal: bool) -> dict:
    """name -> (jitted fn, layout) for the JAX rows: forward fn(q, k, v) and grad fn(q, k, v,
    dO) of sum(o * dO) over q, k, v; layout "bhnd" (cuflash.jax) or "bnhd" (jax.nn)."""
    import jax.numpy as jnp

    import cuflash.jax

    def cuflash_attend(q, k, v):
        return cuflash.jax.attention(q, k, v, causal=causal)

    def nn_attend(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation)

    def grad_of(attend):
        def loss(q, k, v, do):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    out = {}
    for prefix, attend, layout in (("jax", cuflash_attend, "bhnd"),
                                   ("jax_cudnn", nn_attend("cudnn"), "bnhd"),
                                   ("jax_xla", nn_attend("xla"), "bnhd")):
        out[f"{prefix}_fwd"] = (jax.jit(attend), layout)
        out[f"{prefix}_grad"] = (grad_of(attend), layout)
    return out


def jax_inputs(jax, shape: tuple, kv_heads: Optional[int], layout: str, seed: int = 0) -> tuple:
    """(q, k, v, dO) standard normal bf16 in the layout: (B, H, N, d) or (B, N, H, d)."""
    import jax.numpy as jnp

    batch, heads, seq, hdim = shape
    kv = kv_heads or heads

    def dims(h):
        return (batch, h, seq, hdim) if layout == "bhnd" else (batch, seq, h, hdim)

    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(key, dims(h), jnp.bfloat16)
                 for key, h in zip(keys, (heads, kv, kv, heads)))


def jax_calls(jax) -> dict:
    calls = {}
    for name, (fn, layout) in jax_functions(jax, CAUSAL).items():
        q, k, v, do = jax_inputs(jax, HOST_SHAPE, None, layout)
        args = (q, k, v) if name.endswith("_fwd") else (q, k, v, do)
        calls[name] = ((lambda fn=fn, args=args: fn(*args)), jax.block_until_ready)
    return calls


# ---- the table -------------------------------------------------------------------------------


def _entry(us=None, status="ok", error=None) -> dict:
    return {"us": us, "status": status, "error": error}


class Unavailable(Exception):
    """A framework this process lacks: its rows are dashes, not failures."""


def framework_calls(env, framework: str) -> dict:
    """name -> (fn, sync) of one framework's rows; raises Unavailable without it."""
    if framework == "cupy":
        return cupy_calls(env)
    if framework == "torch":
        if env.torch is None:
            raise Unavailable(env.torch_reason)
        return torch_calls(env)
    jax, reason = load_jax()
    if jax is None:
        raise Unavailable(reason)
    return jax_calls(jax)


def run_host(env, args=None, progress=None, calls: int = HOST_CALLS) -> dict:
    """name -> {"us", "status", "error"} for every case."""
    progress = common.as_progress(progress)
    results = {}
    for framework in dict.fromkeys(c.framework for c in CASES):
        cases = [c for c in CASES if c.framework == framework]
        try:
            fns = framework_calls(env, framework)
        except Exception as exc:
            unavailable = isinstance(exc, Unavailable)
            for c in cases:
                results[c.name] = _entry(status="unavailable" if unavailable else "error",
                                         error=str(exc) if unavailable else common.first_line(exc))
            progress.advance(len(cases))
            continue
        progress.start(f"host: the {framework} rows side by side")
        results.update(_interleaved(cases, fns, calls))
        for case in cases:
            progress.advance()
            entry = results[case.name]
            progress.note(f"host {case.api:>14} {case.call:>20}: "
                          + (f"{entry['us']:8.1f} us/call" if entry["us"] is not None
                             else f"{entry['status']}: {entry['error']}"))
        del fns
        env.free_memory()
    return results


def _interleaved(cases, fns: dict, calls: int, rounds: int = HOST_ROUNDS, warmup: int = HOST_WARMUP,
                 clock: Callable[[], float] = time.perf_counter) -> dict:
    """name -> entry of one framework's cases measured side by side: after ``warmup`` calls of
    each, ``rounds`` rounds of ``calls // rounds`` calls of every case (the order reversed
    every other round); a case's us is the median of its rounds. A case whose call raises is
    an error entry and leaves the rounds."""
    per_round = max(1, calls // rounds)
    times, results = {}, {}
    for case in cases:
        fn, sync = fns[case.name]
        try:
            out = None
            for _ in range(warmup):
                out = fn()
            sync(out)
            times[case.name] = []
        except Exception as exc:
            results[case.name] = _entry(status="error", error=common.first_line(exc))
    for r in range(rounds):
        order = [c for c in cases if c.name in times]
        for case in order if r % 2 == 0 else order[::-1]:
            fn, sync = fns[case.name]
            try:
                times[case.name].append(host_us(fn, sync, per_round, 0, clock))
            except Exception as exc:
                del times[case.name]
                results[case.name] = _entry(status="error", error=common.first_line(exc))
    for name, us in times.items():
        results[name] = _entry(statistics.median(us))
    return results


def cuflash_failures(results: dict) -> list:
    return [(f"host: {CASE_BY_NAME[name].api} {CASE_BY_NAME[name].call}", e["error"])
            for name, e in results.items()
            if CASE_BY_NAME[name].is_cuflash and e["status"] == "error"]


def _us_cell(case: Case, entry: Optional[dict], notes: Footnotes) -> str:
    if entry is None:
        return DASH
    if entry["us"] is not None:
        return f"{entry['us']:.1f}"
    if entry["status"] == "unavailable":
        return f"{DASH} {notes.mark(str(entry['error']))}"
    what = "FAILED" if case.is_cuflash else DASH
    return f"{what} {notes.mark(case.api + ' ' + case.call + ': ' + str(entry['error']))}"


def format_host(results: dict, notes: Footnotes, tablefmt: str = "github") -> str:

    headers = ["API", "call", "us / call", "over peer", "target", "target met"]
    rows = []
    for case in CASES:
        entry = results.get(case.name)
        us = entry["us"] if entry else None
        peer = CASE_BY_NAME.get(case.peer) if case.peer else None
        peer_us = (results.get(peer.name) or {}).get("us") if peer else None
        both = us is not None and peer_us is not None
        over = f"{us - peer_us:+.1f} ({peer.api})" if both else DASH
        target = TARGETS.get(case.name)
        met = target.met(us, peer_us) if target else None
        rows.append([case.api, case.call, _us_cell(case, entry, notes), over,
                     target.label(peer.api if peer else None) if target else DASH,
                     DASH if met is None else ("met" if met else "missed")])
    b, h, n, d = HOST_SHAPE
    title = (f"host: CPU microseconds per call, bfloat16 {b} x {h} x {n} x {d} (batch x heads x "
             f"seq x head dim), causal")
    table = common.table(rows, headers, tablefmt, colalign=("left", "left") + ("right",) * 4)
    caption = (f"us / call: the median over {HOST_ROUNDS} rounds, in which a framework's rows take "
               f"turns, of the wall time of {HOST_CALLS // HOST_ROUNDS} back-to-back calls (after "
               f"{HOST_WARMUP} untimed ones) from a drained GPU queue to a drained queue, divided by the calls; "
               "at this size a call's GPU work takes a few microseconds, so the GPU waits for the "
               "host and the figure is the host's time per call. over peer: us / call minus the "
               "peer's. target: issue 14's bound. cuflash (CuPy): cuflash.attention and "
               "cuflash.attention_backward on CuPy arrays; cuflash.torch: cuflash.torch.attention; "
               "SDPA: torch.nn.functional.scaled_dot_product_attention, torch's own backend "
               "choice; fwd + bwd (autograd): out = f(q, k, v), then torch.autograd.grad(out, "
               "(q, k, v), dO). JAX rows under jax.jit: cuflash.jax.attention on (B, H, N, d), "
               "jax.nn.dot_product_attention(implementation='cudnn' / 'xla') on (B, N, H, d); "
               "jit(grad): the gradient of sum(o * dO) over q, k, v.")
    return "\n".join([common.wrap(title), "", table, "", common.wrap(caption)] + notes.lines())
