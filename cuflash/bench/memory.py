"""The memory table: peak extra device memory of one attention forward + backward against the
sequence length, cuflash against PyTorch SDPA (flash, cuDNN, efficient) and standard attention:
linear against quadratic growth, and where standard attention runs out of memory.

One forward and one backward per backend at a fixed batch and head count, layout (batch, heads,
seq, hdim). What is measured is the device memory allocated while they run, above what was
allocated before: the inputs q, k, v and the output gradient dO are made first and are not
counted; the output, the softmax statistics, everything autograd saves, every temporary and the
gradients dq, dk, dv are. Each backend is warmed up first at a short length, so compilation and
one-time set-up are not in the numbers.

- cuflash: CuPy arrays in, ``cuflash.attention`` then ``cuflash.attention_backward``. A
  ``cupy.cuda.MemoryHook`` follows every allocation and free of CuPy's memory pool made inside
  the two calls and keeps the peak of the live bytes. (Through ``cuflash.torch`` the memory
  would be CuPy's, invisible to PyTorch's counters, hence CuPy directly.)
- SDPA (flash, cuDNN, efficient) and standard attention: ``torch.cuda.max_memory_allocated()``
  minus ``torch.cuda.memory_allocated()`` taken just before, after ``reset_peak_memory_stats()``;
  ``out = f(q, k, v)`` then ``torch.autograd.grad(out, (q, k, v), dO)``. Standard attention is
  not run when S and its float32 softmax alone exceed the free memory (shown as OOM, "not run").
- cuflash_torch: the same torch measurement of ``cuflash.torch.attention``, whose CuPy
  allocations go through torch's caching allocator: a cross-check of the cuflash column by
  the other method, plus what the adapter adds.

Both allocators round sizes up to 512 bytes and neither count includes memory cached but not
in use. The functions take an argparse-like namespace with seqlens, hdim, heads, batch, causal
("no" / "yes"), is_causal, dtype, deterministic, peers and tablefmt (:func:`memory_args`).
Importing this module needs neither a GPU nor CuPy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
from typing import Optional

from . import common
from .common import DASH, Footnotes

DEFAULT_SEQLENS = (2048, 4096, 8192, 16384, 32768, 65536)
PEERS = ("cuflash_torch", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "standard")
SDPA_NAMES = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
              "sdpa_efficient": "EFFICIENT_ATTENTION"}
WARMUP_SEQ = 256
MiB = 2**20
LINEAR_MAX = 1.15  # growth exponent up to which memory counts as linear in seqlen
QUADRATIC_MIN = 1.8  # and from which as quadratic


def memory_args(seqlens, hdim: int, dtype: str = "bfloat16", causal: bool = False, peers=PEERS,
                heads: Optional[int] = None, batch: int = 1, deterministic: bool = False,
                tablefmt: str = "github") -> argparse.Namespace:
    """The namespace the functions here take. heads defaults to hidden 2048 / hdim."""
    heads = heads or max(1, common.HIDDEN // hdim)
    return argparse.Namespace(
        seqlens=sorted(set(seqlens)), hdim=hdim, heads=heads, batch=batch,
        causal="yes" if causal else "no", is_causal=bool(causal), dtype=dtype,
        deterministic=deterministic, peers=[p for p in PEERS if p in peers], tablefmt=tablefmt)


def count_steps(args) -> int:
    return len(args.seqlens) * (1 + len(args.peers))


def tensor_bytes(seq: int, hdim: int, heads: int, batch: int, itemsize: int = 2) -> int:
    return batch * heads * seq * hdim * itemsize


def standard_score_bytes(seq: int, heads: int, batch: int, itemsize: int = 2) -> int:
    """Least the standard path needs at once: S in the input dtype plus its float32 softmax."""
    return batch * heads * seq * seq * (itemsize + 4)


class LiveBytes:
    """Live bytes of the allocations seen (by pointer) and their peak.

    Frees of pointers allocated before tracking began are ignored, so the count starts at 0.
    """

    def __init__(self):
        self.sizes: dict = {}
        self.current = 0
        self.peak = 0
        self.allocations = 0

    def malloc(self, ptr: int, size: int) -> None:
        if ptr in self.sizes:  # cannot happen in a pool; keep the count consistent anyway
            self.current -= self.sizes[ptr]
        self.sizes[ptr] = size
        self.current += size
        self.allocations += 1
        self.peak = max(self.peak, self.current)

    def free(self, ptr: int) -> None:
        size = self.sizes.pop(ptr, None)
        if size is not None:
            self.current -= size


def growth_exponent(seq_a: int, mem_a: float, seq_b: int, mem_b: float) -> Optional[float]:
    """p in mem ~ seq^p between two points (None when undefined)."""
    if seq_a <= 0 or seq_b <= 0 or seq_a == seq_b or mem_a <= 0 or mem_b <= 0:
        return None
    return math.log(mem_b / mem_a) / math.log(seq_b / seq_a)


def growth_kind(exponent: Optional[float]) -> str:
    if exponent is None:
        return "unknown"
    if exponent <= LINEAR_MAX:
        return "linear"
    if exponent >= QUADRATIC_MIN:
        return "quadratic"
    return "super-linear"


def growth(records: list, name: str) -> list:
    """For consecutive measured seqlens of one backend: ratios of seq, of memory, exponent."""
    points = [(r["seqlen"], r["backends"][name]["peak_bytes"]) for r in records
              if name in r["backends"] and r["backends"][name].get("peak_bytes")]
    steps = []
    for (sa, ma), (sb, mb) in zip(points, points[1:]):
        p = growth_exponent(sa, ma, sb, mb)
        steps.append({"from": sa, "to": sb, "seq_ratio": sb / sa, "memory_ratio": mb / ma,
                      "exponent": p, "kind": growth_kind(p)})
    return steps


def mib(nbytes: Optional[float]) -> str:
    return DASH if nbytes is None else f"{nbytes / MiB:.1f}"


def memory_cell(entry: Optional[dict], notes: Footnotes, name: str) -> str:
    if entry is None:
        return DASH
    if entry["status"] == "ok":
        return mib(entry["peak_bytes"])
    if name == "cuflash" and entry["status"] == "error":
        return f"FAILED {notes.mark(name + ': ' + str(entry.get('error')))}"
    if entry["status"] == "unavailable":
        return f"{DASH} {notes.mark('PyTorch columns: ' + str(entry.get('error')))}"
    if entry["status"] == "oom":
        return f"OOM {notes.mark(name + ': ' + entry['error'])}" if entry.get("error") else "OOM"
    return f"{DASH} {notes.mark(name + ': ' + (entry.get('error') or entry['status']))}"


def counted_note(args) -> str:
    return ("Counted: all device memory allocated during one forward + backward and live at "
            "its peak, above what was allocated before: the output o, the softmax statistics "
            "(cuflash l and m, SDPA's logsumexp), what autograd saves, temporaries, and the "
            "gradients dq, dk, dv. Not counted: the inputs q, k, v and dO (allocated before), "
            "compiled kernels, library workspaces made in the warm-up, memory cached but not in "
            "use. cuflash: cuflash.attention + cuflash.attention_backward"
            f"{' (deterministic=True)' if args.deterministic else ''} on CuPy arrays, CuPy "
            "memory-pool live bytes followed by a cupy.cuda.MemoryHook. cuflash_torch "
            "(cuflash.torch.attention, which allocates through torch), SDPA and standard: "
            "torch.cuda.max_memory_allocated() - memory_allocated() before, "
            "torch.autograd.grad(out, (q, k, v), dO).")


STANDARD_NOTE = ("Standard: torch autograd of S = (q @ k^T) * scale in the input dtype"
                 " (causal: masked_fill with an N x N bool mask made beforehand, not counted),"
                 " softmax in float32, cast back, @ v.")


def standard_oom_line(records: list, args, device_bytes: Optional[int] = None) -> Optional[str]:
    """Where standard attention runs out of memory: measured, and from its S alone."""
    if "standard" not in args.peers:
        return None
    ran = [r["seqlen"] for r in records
           if (r["backends"].get("standard") or {}).get("status") == "ok"]
    oom = [r["seqlen"] for r in records
           if (r["backends"].get("standard") or {}).get("status") == "oom"]
    if oom:
        text = f"standard attention runs out of memory from seq {min(oom)} on"
        text += f" (the longest that ran: {max(ran)})" if ran else " (it ran at no length)"
    elif ran:
        text = f"standard attention ran at every length measured (up to {max(ran)})"
    else:
        return None
    if device_bytes:
        per = args.heads * args.batch * (common.ITEMSIZE.get(args.dtype, 2) + 4)
        n_full = math.sqrt(device_bytes / per)
        text += (f"; S and its float32 softmax alone ({args.heads} x {args.batch} x N^2 x "
                 f"{common.ITEMSIZE.get(args.dtype, 2) + 4} bytes) fill the device's "
                 f"{device_bytes / 2**30:.0f} GiB at N = {n_full:.0f}")
    return text + "."


def format_table(records: list, args, notes: Footnotes, device_bytes: Optional[int] = None) -> str:

    names = ["cuflash"] + list(args.peers)
    headers = ["seqlen", "o+dq+dk+dv MiB"]
    headers += [f"{common.SHORT_NAMES.get(name, name)} MiB" for name in names]
    if "sdpa_flash" in names:
        headers.append("cuflash / flash")
    rows = []
    for r in records:
        row = [r["seqlen"], mib(r["outputs_bytes"])]
        row += [memory_cell(r["backends"].get(name), notes, name) for name in names]
        if "sdpa_flash" in names:
            mine, theirs = r["backends"].get("cuflash"), r["backends"].get("sdpa_flash")
            ok = (mine and theirs and mine.get("peak_bytes") and theirs.get("peak_bytes"))
            row.append(f"{mine['peak_bytes'] / theirs['peak_bytes']:.2f}x" if ok else DASH)
        rows.append(row)
    title = (f"peak extra memory of forward + backward, {args.dtype}, head dim {args.hdim}, "
             f"{args.heads} heads, batch {args.batch}, causal={args.causal}")
    table = common.table(rows, headers, args.tablefmt, colalign=("right",) * len(headers))
    lines = [common.wrap(title), "", table, ""]
    for name in names:
        steps = growth(records, name)
        if steps:
            parts = [f"{s['from']}->{s['to']} ({s['seq_ratio']:g}x seq): "
                     f"x{s['memory_ratio']:.2f} ({s['kind']})" for s in steps]
            lines.append(common.wrap(f"growth, {name}: " + "; ".join(parts), indent="    "))
    oom_line = standard_oom_line(records, args, device_bytes)
    if oom_line:
        lines.append(common.wrap(oom_line))
    lines.append("")
    lines.append(common.wrap("MiB = 2^20 bytes. o+dq+dk+dv: the four (batch, heads, seq, hdim) tensors "
                 "every backend must return (the uncounted inputs q, k, v, dO are as large); "
                 "the rest of a column is statistics, saved state and temporaries. growth: memory ratio between consecutive lengths; 4x seq "
                 f"gives x4 when linear, x16 when quadratic (exponent <= {LINEAR_MAX} linear, "
                 f">= {QUADRATIC_MIN} quadratic); flash, cudnn, efficient: SDPA pinned to that "
                 "backend; cuflash / flash: cuflash's memory / flash's."))
    lines.append(common.wrap(counted_note(args)))
    if "standard" in names:
        lines.append(common.wrap(STANDARD_NOTE))
    lines += notes.lines()
    return "\n".join(lines)


# ---- GPU measurements --------------------------------------------------------------------


def pool_hook(cupy):
    """A cupy.cuda.MemoryHook whose .live (LiveBytes) follows the memory pool."""

    class PoolPeakHook(cupy.cuda.MemoryHook):
        name = "PoolPeakHook"

        def __init__(self):
            self.live = LiveBytes()

        def malloc_postprocess(self, **kwargs):
            self.live.malloc(kwargs["mem_ptr"], kwargs["mem_size"])

        def free_postprocess(self, **kwargs):
            self.live.free(kwargs["mem_ptr"])

    return PoolPeakHook()


def free_everything(env) -> None:
    gc.collect()
    env.free_memory()


def make_inputs(env, shape):
    """q, k, v and dO, standard normal in the benchmark dtype (torch tensors if torch is here)."""
    return tuple(common.random_tensor(env, shape) for _ in range(4))


def cuflash_fwd_bwd(env, args, q, k, v, do):
    import cuflash

    o, l, m = cuflash.attention(q, k, v, causal=args.is_causal)
    grads = cuflash.attention_backward(do, q, k, v, o, l, m, causal=args.is_causal,
                                       deterministic=args.deterministic)
    return (o, l, m), tuple(grads)


def measure_cuflash(env, args, inputs) -> dict:
    cupy = env.cupy
    q, k, v, do = (common.as_cupy(env, x) for x in inputs)
    hook = pool_hook(cupy)
    cupy.cuda.get_current_stream().synchronize()
    with hook:
        out, grads = cuflash_fwd_bwd(env, args, q, k, v, do)
        cupy.cuda.get_current_stream().synchronize()
    retained = hook.live.current
    del out, grads
    return {"status": "ok", "error": None, "peak_bytes": hook.live.peak,
            "retained_bytes": retained, "allocations": hook.live.allocations}


def cuflash_torch_forward(causal: bool):
    import cuflash.torch

    def run(q, k, v):
        return cuflash.torch.attention(q, k, v, causal=causal)

    return run


def sdpa_forward(env, name: str, causal: bool):
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_NAMES[name])

    def run(q, k, v):
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def standard_forward(env, seq: int, hdim: int, causal: bool):
    torch = env.torch
    scale = 1.0 / math.sqrt(hdim)
    mask = None
    if causal:  # True where key j > query i: masked; built before the measurement
        mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu_(1)

    def run(q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, v)

    return run, mask


def measure_torch(env, forward, inputs) -> dict:
    torch = env.torch
    q, k, v = (x.detach().requires_grad_() for x in inputs[:3])
    do = inputs[3]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    retained = torch.cuda.memory_allocated() - before
    del out, grads
    return {"status": "ok", "error": None, "peak_bytes": peak, "retained_bytes": retained}


@contextlib.contextmanager
def deterministic_torch(env, on: bool):
    """torch.use_deterministic_algorithms(True) inside (cuflash.torch's deterministic switch)."""
    if not on:
        yield
        return
    before = env.torch.are_deterministic_algorithms_enabled()
    env.torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        env.torch.use_deterministic_algorithms(before)


def measure(env, args, name: str, seq: int, inputs, warm: set) -> dict:
    """One backend at one length; a peer's failure becomes a status, never an exception."""
    shape = (args.batch, args.heads, seq, args.hdim)
    if name != "cuflash" and env.torch is None:
        return {"status": "unavailable", "error": env.torch_reason, "peak_bytes": None}
    try:
        if name == "cuflash":
            if name not in warm:  # compile outside the measurement
                small = make_inputs(env, shape[:2] + (WARMUP_SEQ, args.hdim))
                measure_cuflash(env, args, small)
                del small
                warm.add(name)
            return measure_cuflash(env, args, inputs)
        if name == "standard":
            need = standard_score_bytes(seq, args.heads, args.batch,
                                        common.ITEMSIZE.get(args.dtype, 2))
            free, _ = env.torch.cuda.mem_get_info()
            if need > free:
                return {"status": "oom", "peak_bytes": None,
                        "error": f"not run: S and its float32 softmax alone need "
                                 f"{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
            forward, _ = standard_forward(env, seq, args.hdim, args.is_causal)
        elif name == "cuflash_torch":
            forward = cuflash_torch_forward(args.is_causal)
        else:
            forward = sdpa_forward(env, name, args.is_causal)
        with deterministic_torch(env, name == "cuflash_torch" and args.deterministic):
            if name not in warm:
                small = make_inputs(env, shape[:2] + (WARMUP_SEQ, args.hdim))
                warm_forward = forward
                if name == "standard":
                    warm_forward, _ = standard_forward(env, WARMUP_SEQ, args.hdim,
                                                       args.is_causal)
                measure_torch(env, warm_forward, small)
                del small, warm_forward
                warm.add(name)
            return measure_torch(env, forward, inputs)
    except Exception as exc:
        # cuflash's own failures are recorded too: FAILED in the table, exit status 1
        oom = common.is_oom(env, exc)
        return {"status": "oom" if oom else "error", "peak_bytes": None,
                "error": None if oom else common.first_line(exc)}


def run_all(env, args, progress=None) -> list:
    progress = common.as_progress(progress)
    records = []
    warm: set = set()
    names = ["cuflash"] + list(args.peers)
    itemsize = common.ITEMSIZE.get(args.dtype, 2)
    for seq in args.seqlens:
        shape = (args.batch, args.heads, seq, args.hdim)
        nbytes = 4 * tensor_bytes(seq, args.hdim, args.heads, args.batch, itemsize)
        record = {"seqlen": seq, "batch": args.batch, "heads": args.heads, "hdim": args.hdim,
                  "causal": args.is_causal, "dtype": args.dtype, "inputs_bytes": nbytes,
                  "outputs_bytes": nbytes, "backends": {}}
        inputs = make_inputs(env, shape)
        for name in names:
            progress.start(f"memory seq {seq}: {name}")
            entry = measure(env, args, name, seq, inputs, warm)
            record["backends"][name] = entry
            free_everything(env)
            progress.advance()
            if entry.get("peak_bytes") is not None:
                progress.note(f"memory seq {seq} {name:>14}: peak {mib(entry['peak_bytes'])} "
                              f"MiB, retained {mib(entry['retained_bytes'])} MiB")
            else:
                progress.note(f"memory seq {seq} {name:>14}: {entry['status']}: "
                              f"{entry.get('error')}")
        del inputs
        free_everything(env)
        records.append(record)
    return records


def json_settings(args) -> dict:
    return {"seqlens": args.seqlens, "hdim": args.hdim, "heads": args.heads,
            "batch": args.batch, "causal": args.is_causal, "dtype": args.dtype,
            "deterministic": args.deterministic, "peers": list(args.peers),
            "counted": counted_note(args)}


def growth_all(records: list, args) -> dict:
    return {name: growth(records, name) for name in ["cuflash"] + list(args.peers)}


def cuflash_failures(records: list) -> list:
    return [(f"memory seq {r['seqlen']}: cuflash", r["backends"]["cuflash"].get("error"))
            for r in records
            if (r["backends"].get("cuflash") or {}).get("status") not in ("ok", None)]
