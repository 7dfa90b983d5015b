"""The varlen table: a training batch of sequences of mixed lengths, packed into one row with
sequence boundaries (cu_seqlens) against the same batch padded to its longest sequence; and
equal-length sequences packed against the same tokens through cuflash's dense path.

Batches (bfloat16, causal, for each head layout of HEADS: 32 query heads over 8 k/v heads at
head dim 128, Llama-style GQA, and 12 over 12 at head dim 64, GPT-2-like):

- ``mixed``: MIXED_SEQUENCES lengths drawn uniformly from MIXED_SHORTEST..MIXED_LONGEST with
  numpy's default_rng(LENGTH_SEED), so every run times the same batch;
- ``equal``: each (sequences, length) of EQUAL_BATCHES.

Inputs are random normal (total tokens, heads, head dim) tensors, the layout a model's
projections produce; dO is random too. The padded batch is built from the same values, outside
the timing: (sequences, longest, heads, head dim), each sequence at the start of its row,
zeros after it (dO too, as a loss that ignores the padding gives).

Rows (MIXED_ROWS, EQUAL_ROWS), all through PyTorch, each timed as the user calls it:

- cuflash packed: ``cuflash.torch.attention(q, k, v, causal=True, cu_seqlens_q=cu,
  cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)`` on (heads, total, head dim)
  views (``x.transpose(0, 1)``, no copy), cu the int32 (sequences + 1,) boundaries on the GPU;
- cuflash padded: ``cuflash.torch.attention(q, k, v, causal=True)`` on the padded batch viewed
  (sequences, heads, longest, head dim); for an equal batch, ``dense``: the packed tensors viewed
  so, the same memory;
- SDPA flash / cuDNN padded: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
  (``enable_gqa=True`` for grouped heads) under ``sdpa_kernel`` pinned to the backend, on the
  padded views, with no mask. None is needed: a sequence's real query i sees keys j <= i, all
  real, so the real tokens' outputs are exact; with dO zero on the padding their gradients are
  too. The padded rows are computed and thrown away. (SDPA's flash backend refuses any
  attn_mask, and a boolean padding mask would be (sequences, 1, longest, longest) bytes.)
- SDPA flash / cuDNN nested: the packed tensors as jagged nested tensors,
  ``torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=, max_seqlen=)
  .transpose(1, 2)``, through the same pinned SDPA with ``is_causal=True``: torch's own
  padding-free path, which runs the backends' variable-length kernels. Jagged SDPA takes no
  mask and no grouped k/v heads in training ("do not support training with broadcasted NT
  inputs"), so with grouped heads k and v are repeated to the query heads
  (``repeat_interleave``) inside the timed call.

Modes: ``fwd`` (the call alone, on tensors that need no grad) and ``fwdbwd`` (out = attend(q,
k, v), then ``torch.autograd.grad(out, (q, k, v), dO)``, the graph recorded inside the timing).

TFLOP/s counts the useful work only, the same for every row of a batch: the sum over sequences
of :func:`cuflash.bench.io.flops` at each one's length (4 L^2 d Hq, halved causal; forward +
backward 3.5x). Padding fractions: of the tokens, 1 - total / (sequences * longest); of the
FLOPs, 1 - useful / padded FLOPs. Targets (issue 17): on the mixed batch, packed cuflash beats
padded SDPA by at least the padding it saves, padded time / packed time >= padded FLOPs /
useful FLOPs; at equal lengths packed runs at >= 0.95x the dense path's speed.

Timing is the speed table's (:func:`cuflash.bench.common.time_call`: CUDA events around each of
back-to-back calls after warm-up, the median; input sets rotated past L2), host time included
when the GPU waits for it. A build whose ``cuflash.torch.attention`` has no ``cu_seqlens_q``
shows its packed rows as a dash with a footnote; a failing peer is a dash with its reason.

Importing this module needs neither a GPU, CuPy nor PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from typing import Callable, Optional

from . import common, host
from .common import DASH, Footnotes, time_call
from .decode import accepts_keyword
from .io import MODE_FLOP_FACTOR, flops
from .speed import MODE_NAMES, SDPA_BACKENDS

CAUSAL = True
DTYPE = "bfloat16"
MODES = ("fwd", "fwdbwd")
MIXED_SEQUENCES = 64
MIXED_SHORTEST, MIXED_LONGEST = 128, 8192  # both ends can be drawn
LENGTH_SEED = 0
EQUAL_BATCHES = ((16, 4096), (64, 1024))  # (sequences, length): 64k tokens each
EQUAL_TARGET = 0.95  # issue 17: packed equal lengths at >= 0.95x the dense path's speed
NOT_IN_BUILD = "packed variable-length batches (cu_seqlens_q=, cu_seqlens_k=) not in this build"
DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Heads:
    q: int
    kv: int
    hdim: int
    note: str

    @property
    def group(self) -> int:
        """Query heads per k/v head."""
        return self.q // self.kv


HEADS = (Heads(32, 8, 128, "Llama-style GQA"), Heads(12, 12, 64, "GPT-2-like"))


@dataclasses.dataclass(frozen=True)
class Batch:
    kind: str  # mixed | equal
    lengths: tuple

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"a varlen batch needs sequences of at least one token, got "
                             f"lengths {self.lengths}")

    @property
    def sequences(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @property
    def label(self) -> str:
        if self.kind == "equal":
            return f"{self.sequences} x {self.lengths[0]}"
        return f"{self.sequences} mixed"

    @property
    def pad_token_fraction(self) -> float:
        return 1 - self.tokens / (self.sequences * self.longest)


def mixed_batch(sequences: int = MIXED_SEQUENCES, shortest: int = MIXED_SHORTEST,
                longest: int = MIXED_LONGEST, seed: int = LENGTH_SEED) -> Batch:
    """The mixed batch: lengths drawn uniformly from shortest..longest (inclusive)."""
    import numpy as np

    if not 1 <= shortest <= longest or sequences < 1:
        raise ValueError(f"mixed batch: want sequences >= 1 and 1 <= shortest <= longest, got "
                         f"{sequences} sequences of {shortest}..{longest} tokens")
    drawn = np.random.default_rng(seed).integers(shortest, longest, endpoint=True, size=sequences)
    return Batch("mixed", tuple(int(n) for n in drawn))


def equal_batch(sequences: int, length: int) -> Batch:
    return Batch("equal", (length,) * sequences)


@dataclasses.dataclass(frozen=True)
class Row:
    """One backend of a batch's rows."""

    name: str  # the JSON key
    backend: str  # the table's label
    layout: str  # packed | padded | nested | dense
    sdpa: Optional[str] = None  # the pinned SDPA backend: a key of speed.SDPA_BACKENDS

    @property
    def is_cuflash(self) -> bool:
        return self.sdpa is None


PACKED = "cuflash_packed"
MIXED_ROWS = (Row(PACKED, "cuflash", "packed"),
              Row("cuflash_padded", "cuflash", "padded"),
              Row("sdpa_flash_padded", "SDPA flash", "padded", "sdpa_flash"),
              Row("sdpa_cudnn_padded", "SDPA cuDNN", "padded", "sdpa_cudnn"),
              Row("sdpa_flash_nested", "SDPA flash", "nested", "sdpa_flash"),
              Row("sdpa_cudnn_nested", "SDPA cuDNN", "nested", "sdpa_cudnn"))
EQUAL_ROWS = (Row(PACKED, "cuflash", "packed"), Row("cuflash_dense", "cuflash", "dense"))
ROWS = {"mixed": MIXED_ROWS, "equal": EQUAL_ROWS}
PADDING_TARGET_ROWS = ("sdpa_flash_padded", "sdpa_cudnn_padded")


# ---- pure helpers (no GPU) ---------------------------------------------------------------


def cu_seqlens(lengths):
    """A NumPy int32 (sequences + 1,) array: where each sequence starts in the packed row, then the total."""
    import numpy as np

    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def padded_rows(lengths):
    """For each packed token, its row in the padded batch flattened to (sequences * longest),
    a NumPy int array: sequence b's token i at b * longest + i."""
    import numpy as np

    longest = max(lengths)
    return np.concatenate([b * longest + np.arange(n) for b, n in enumerate(lengths)])


def useful_flops(batch: Batch, heads: Heads, mode: str) -> float:
    """FLOPs of the real work: each sequence's attention at its own length."""
    return float(sum(flops(n, heads.hdim, heads.q, 1, CAUSAL, mode) for n in batch.lengths))


def padded_flops(batch: Batch, heads: Heads, mode: str) -> float:
    """FLOPs of the batch padded to its longest sequence."""
    return flops(batch.longest, heads.hdim, heads.q, batch.sequences, CAUSAL, mode)


def pad_flop_fraction(batch: Batch, heads: Heads) -> float:
    """The share of the padded batch's FLOPs that padding adds (the same in every mode)."""
    return 1 - useful_flops(batch, heads, "fwd") / padded_flops(batch, heads, "fwd")


def target(record: dict, name: str) -> Optional[float]:
    """The least (row time / packed time) issue 17 asks of a row, or None."""
    if record["batch"] == "mixed" and name in PADDING_TARGET_ROWS:
        return record["padded_flops"] / record["useful_flops"]
    if record["batch"] == "equal" and name == "cuflash_dense":
        return EQUAL_TARGET
    return None


def count_steps(heads: tuple = HEADS, equal: tuple = EQUAL_BATCHES) -> int:
    """Measurements: per head layout and mode, the mixed batch's rows and each equal batch's."""
    return len(heads) * len(MODES) * (len(MIXED_ROWS) + len(equal) * len(EQUAL_ROWS))


def variant_shapes(heads: tuple = HEADS) -> set:
    """(dtype, head dim, causal) of the dense cuflash kernels the table launches."""
    return {(DTYPE, h.hdim, CAUSAL) for h in heads}


# ---- tensors: layouts of one packed batch -------------------------------------------------


def pad(x, lengths):
    """Packed (total, ...) -> padded (sequences, longest, ...): each sequence at the start of
    its row, zeros after it. A copy, made outside the timing."""
    import torch

    rows = torch.as_tensor(padded_rows(lengths), device=x.device)
    out = x.new_zeros((len(lengths) * max(lengths),) + tuple(x.shape[1:]))
    out[rows] = x
    return out.unflatten(0, (len(lengths), max(lengths)))


def view_as(layout: str, x, lengths):
    """What a row's call takes, from its input tensor: packed (total, H, d) -> (H, total, d);
    nested: the packed tensor itself; padded (B, longest, H, d) -> (B, H, longest, d); dense:
    the packed tensor of equal lengths viewed (B, H, L, d). Views only."""
    if layout == "packed":
        return x.transpose(0, 1)
    if layout == "nested":
        return x
    if layout == "padded":
        return x.transpose(1, 2)
    if layout == "dense":
        return x.unflatten(0, (len(lengths), lengths[0])).transpose(1, 2)
    raise ValueError(f"layout must be packed, nested, padded or dense, got {layout!r}")


def unpack(layout: str, out, lengths):
    """A row's output o back in the packed (total, H, d) order, to compare rows."""
    import torch

    if layout == "packed":
        return out.transpose(0, 1)
    if layout == "nested":
        return out
    flat = out.transpose(1, 2).flatten(0, 1)
    if layout == "dense":
        return flat
    if layout == "padded":
        return flat[torch.as_tensor(padded_rows(lengths), device=out.device)]
    raise ValueError(f"layout must be packed, nested, padded or dense, got {layout!r}")


def max_abs_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


# ---- the calls timed ---------------------------------------------------------------------


def cuflash_packed_attend(lengths, device: str = DEVICE) -> Optional[Callable]:
    """cuflash's variable-length call on (H, total, d) views, or None when this build's torch
    adapter has no cu_seqlens_q."""
    import torch

    import cuflash.torch

    if not accepts_keyword(cuflash.torch.attention, "cu_seqlens_q"):
        return None
    cu = torch.as_tensor(cu_seqlens(lengths), device=device)
    longest = max(lengths)
    return lambda q, k, v: cuflash.torch.attention(
        q, k, v, causal=CAUSAL, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
        max_seqlen_k=longest)


def sdpa_nested_attend(torch, lengths, group: int, device: str = DEVICE,
                       causal: bool = CAUSAL) -> Callable:
    """SDPA on jagged nested tensors made from packed (total, H, d) tensors; returns the packed
    (total, Hq, d) output. k, v are repeated to the query heads when group > 1 (jagged SDPA
    does not train with broadcast heads). min and max lengths are given so that no call reads
    them back from the GPU."""
    from torch.nested import nested_tensor_from_jagged

    sdpa = torch.nn.functional.scaled_dot_product_attention
    offsets = torch.as_tensor(cu_seqlens(lengths), dtype=torch.int64, device=device)
    shortest, longest = min(lengths), max(lengths)

    def jagged(x):
        return nested_tensor_from_jagged(x, offsets, min_seqlen=shortest,
                                         max_seqlen=longest).transpose(1, 2)

    def attend(q, k, v):
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return sdpa(jagged(q), jagged(k), jagged(v), is_causal=causal).transpose(1, 2).values()

    return attend


def sdpa_context(name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_BACKENDS[name])
    return lambda: sdpa_kernel(which)


def attend_of(env, row: Row, batch: Batch, heads: Heads):
    """(attend(q, k, v), context entered around the calls) of a row, or None when the build
    lacks the call."""
    if row.layout == "packed":
        attend = cuflash_packed_attend(batch.lengths)
        return None if attend is None else (attend, contextlib.nullcontext)
    if row.is_cuflash:
        return host.cuflash_torch_attend(CAUSAL), contextlib.nullcontext
    if row.layout == "padded":
        return host.sdpa_attend(env.torch, CAUSAL, heads.group > 1), sdpa_context(row.sdpa)
    return (sdpa_nested_attend(env.torch, batch.lengths, heads.group),
            sdpa_context(row.sdpa))


# ---- measurement -------------------------------------------------------------------------


def _entry(ms=None, status="ok", error=None, times=None, flop=0.0) -> dict:
    return {"ms": ms, "status": status, "error": error, "times_ms": times or [],
            "tflops": flop / (ms * 1e-3) / 1e12 if ms else None}


def input_sets(env, batch: Batch, heads: Heads) -> list:
    """(q, k, v, dO) packed (total, H, d) sets to rotate among: together more than twice L2."""
    itemsize = common.ITEMSIZE[DTYPE]
    set_bytes = batch.tokens * heads.hdim * itemsize * 2 * (heads.q + heads.kv)
    shapes = [(batch.tokens, h, heads.hdim) for h in (heads.q, heads.kv, heads.kv, heads.q)]
    return [tuple(common.random_tensor(env, s) for s in shapes)
            for _ in range(common.num_input_sets(set_bytes, env.l2_bytes))]


def _measure(env, args, row: Row, batch: Batch, heads: Heads, mode: str, sets: list):
    """(entry, the first call's output in the forward mode) of one row; a failure becomes the
    entry."""
    torch = env.torch
    try:
        made = attend_of(env, row, batch, heads)
        if made is None:
            return _entry(status="unavailable", error=NOT_IN_BUILD), None
        attend, context = made

        def view(x):
            return view_as(row.layout, x, batch.lengths)

        if mode == "fwd":
            fn, timed = attend, [tuple(view(x) for x in s[:3]) for s in sets]
        else:
            def fn(q, k, v, do):
                return torch.autograd.grad(attend(q, k, v), (q, k, v), do)

            timed = [tuple(view(x).detach().requires_grad_() for x in s[:3]) + (view(s[3]),)
                     for s in sets]
        with context():
            times, first = time_call(env.cupy, fn, timed, args.warmup, args.repeats)
        return (_entry(statistics.median(times), times=times,
                       flop=useful_flops(batch, heads, mode)),
                first if mode == "fwd" else None)
    except Exception as exc:
        failed = _entry(status="oom" if common.is_oom(env, exc) else "error",
                        error=common.first_line(exc))
    env.free_memory()  # after the except block, whose traceback held the failed call's arrays
    return failed, None


def varlen_table(env, args, progress=None, heads: tuple = HEADS, mixed: Optional[Batch] = None,
                 equal: tuple = EQUAL_BATCHES) -> list:
    """Every head layout's mixed batch and equal batches in both modes; a record per (batch,
    head layout, mode). args: warmup and repeats (as for the other tables). progress: a
    common.Progress, or a string that prefixes plain log lines."""
    progress = common.as_progress(progress)
    mixed = mixed or mixed_batch()
    records = []
    for h in heads:
        for batch in [mixed] + [equal_batch(b, n) for b, n in equal]:
            records += _run_batch(env, args, progress, batch, h)
            env.free_memory()
    return records


def _record(batch: Batch, heads: Heads, mode: str) -> dict:
    return {"table": "varlen", "batch": batch.kind, "label": batch.label,
            "lengths": list(batch.lengths), "sequences": batch.sequences,
            "tokens": batch.tokens, "longest": batch.longest, "heads_q": heads.q,
            "heads_kv": heads.kv, "hdim": heads.hdim, "note": heads.note, "dtype": DTYPE,
            "causal": CAUSAL, "mode": mode, "useful_flops": useful_flops(batch, heads, mode),
            "padded_flops": padded_flops(batch, heads, mode),
            "pad_token_fraction": batch.pad_token_fraction,
            "pad_flop_fraction": pad_flop_fraction(batch, heads),
            "backends": {}, "max_abs_diff_vs_packed": {}}


def _run_batch(env, args, progress, batch: Batch, heads: Heads) -> list:
    rows = ROWS[batch.kind]
    records = [_record(batch, heads, mode) for mode in MODES]
    if env.torch is None:
        for record in records:
            record["backends"] = {r.name: _entry(status="unavailable", error=env.torch_reason)
                                  for r in rows}
        progress.advance(len(rows) * len(MODES))
        return records
    try:
        packed_sets = input_sets(env, batch, heads)
        padded_sets = ([tuple(pad(x, batch.lengths) for x in s) for s in packed_sets]
                       if any(r.layout == "padded" for r in rows) else None)
    except Exception as exc:  # no inputs: every row of the batch fails the same way
        failed = _entry(status="oom" if common.is_oom(env, exc) else "error",
                        error=f"making the inputs: {common.first_line(exc)}")
        for record in records:
            record["backends"] = {r.name: dict(failed) for r in rows}
        progress.advance(len(rows) * len(MODES))
        return records
    label = f"varlen {heads.q}/{heads.kv} heads hdim {heads.hdim} {batch.label}"
    for record in records:
        mode = record["mode"]
        packed_out = None
        for row in rows:
            progress.start(f"{label} {mode}: {row.name}")
            sets = padded_sets if row.layout == "padded" else packed_sets
            entry, out = _measure(env, args, row, batch, heads, mode, sets)
            record["backends"][row.name] = entry
            check = ""
            if out is not None:
                out = unpack(row.layout, out, batch.lengths)
                if row.name == PACKED:
                    packed_out = out
                elif packed_out is not None:
                    diff = max_abs_diff(out, packed_out)
                    record["max_abs_diff_vs_packed"][row.name] = diff
                    check = f", max|o - o_packed| = {diff:.2e}"
            del out
            progress.advance()
            progress.note(f"{label} {mode} {row.name:>17}: " + (
                f"{entry['ms']:.3f} ms {entry['tflops']:.0f} TFLOP/s{check}"
                if entry["ms"] is not None else f"{entry['status']}: {entry['error']}"))
        del packed_out
    del packed_sets, padded_sets
    return records


def cuflash_failures(records: list) -> list:
    """(label, error) of every cuflash measurement that failed (a build without the packed
    call is not a failure)."""
    out = []
    for r in records:
        for row in ROWS[r["batch"]]:
            entry = r["backends"].get(row.name)
            if row.is_cuflash and entry and entry["status"] in ("error", "oom"):
                out.append((f"varlen {r['heads_q']}/{r['heads_kv']} heads hdim {r['hdim']} "
                            f"{r['label']} {r['mode']}: {row.name}", entry["error"]))
    return out


def json_settings(heads: tuple = HEADS, mixed: Optional[Batch] = None,
                  equal: tuple = EQUAL_BATCHES) -> dict:
    mixed = mixed or mixed_batch()
    return {"mixed": {"sequences": MIXED_SEQUENCES, "shortest": MIXED_SHORTEST,
                      "longest": MIXED_LONGEST, "seed": LENGTH_SEED,
                      "lengths": list(mixed.lengths)},
            "equal": [list(e) for e in equal], "heads": [dataclasses.asdict(h) for h in heads],
            "modes": list(MODES), "dtype": DTYPE, "causal": CAUSAL,
            "flop_factors": {m: MODE_FLOP_FACTOR[m] for m in MODES},
            "equal_target": EQUAL_TARGET}


# ---- report ------------------------------------------------------------------------------

LAYOUT_LABELS = {"packed": "packed", "nested": "nested", "dense": "dense"}


def _layout_cell(row: Row, record: dict) -> str:
    if row.layout == "padded":
        return f"padded to {record['longest']}"
    return LAYOUT_LABELS[row.layout]


def _time_cells(row: Row, entry: Optional[dict], notes: Footnotes) -> list:
    """[ms, TFLOP/s] of a row; a missing one is a dash (cuflash's failure FAILED), its reason a
    footnote."""
    if entry is None:
        return [DASH, DASH]
    if entry["ms"] is not None:
        return [f"{entry['ms']:.3f}", f"{entry['tflops']:.0f}"]
    if entry["status"] == "oom":
        return ["OOM", DASH]
    if entry["status"] == "unavailable":
        return [f"{DASH} {notes.mark(str(entry['error']))}", DASH]
    what = "FAILED" if row.is_cuflash else DASH
    reason = f"{row.backend} {row.layout}: {entry['error']}"
    return [f"{what} {notes.mark(reason)}", DASH]


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def format_varlen(records: list, notes: Footnotes, tablefmt: str = "github") -> str:
    """One table per (head layout, mode); a row per batch and backend."""
    headers = ["batch", "backend", "layout", "ms", "TFLOP/s", "pad tokens", "pad FLOPs",
               "vs packed", "target", "met"]
    groups = dict.fromkeys((r["heads_q"], r["heads_kv"], r["hdim"], r["note"], r["mode"])
                           for r in records)
    blocks = []
    for hq, hk, d, note, mode in groups:
        rows = []
        for r in records:
            if (r["heads_q"], r["heads_kv"], r["hdim"], r["note"], r["mode"]) != (hq, hk, d, note, mode):
                continue
            packed = r["backends"].get(PACKED) or {}
            for row in ROWS[r["batch"]]:
                entry = r["backends"].get(row.name)
                padded = row.layout == "padded"
                ms = (entry or {}).get("ms")
                ratio = (ms / packed["ms"] if ms is not None and packed.get("ms") is not None
                         and row.name != PACKED else None)
                least = target(r, row.name)
                rows.append([r["label"], row.backend, _layout_cell(row, r),
                             *_time_cells(row, entry, notes),
                             _percent(r["pad_token_fraction"] if padded else 0.0),
                             _percent(r["pad_flop_fraction"] if padded else 0.0),
                             "" if row.name == PACKED else (DASH if ratio is None else f"{ratio:.2f}x"),
                             "" if least is None else f">= {least:.2f}x",
                             "" if least is None else (DASH if ratio is None else
                                                       ("met" if ratio >= least else "missed"))])
        title = (f"varlen: {MODE_NAMES[mode]}, {hq} query / {hk} k-v heads ({note}), head dim "
                 f"{d}, {DTYPE}, causal")
        blocks.append(common.wrap(title) + "\n\n" + common.table(
            rows, headers, tablefmt, colalign=("left", "left", "left") + ("right",) * 7))
    caption = _caption(records)
    return "\n\n".join(blocks) + "\n\n" + "\n".join([common.wrap(caption)] + notes.lines())


def _caption(records: list) -> str:
    mixed = next((r for r in records if r["batch"] == "mixed"), None)
    text = ""
    if mixed:
        text += (f"mixed: {mixed['sequences']} sequences drawn uniformly from "
                 f"{min(mixed['lengths'])}..{max(mixed['lengths'])} tokens (the draw of "
                 f"{MIXED_SHORTEST}..{MIXED_LONGEST}, seed {LENGTH_SEED}), {mixed['tokens']} "
                 f"tokens; padded to the longest, {mixed['sequences']} x {mixed['longest']}. ")
    text += (f"B x L: equal lengths. ms: median time of one call (CUDA events around each of "
             f"back-to-back calls after warm-up). TFLOP/s: the real work only, the sum over "
             f"sequences of 4 L^2 d Hq (halved causal; forward + backward "
             f"{MODE_FLOP_FACTOR['fwdbwd']:g}x) / time, the same count for every row of a "
             f"batch. pad tokens, pad FLOPs: the share of the padded batch that is padding. vs "
             f"packed: the row's time / cuflash packed's (packed's speed as a multiple of the "
             f"row's). target, issue 17: packed beats padded SDPA by at least the padding it "
             f"saves (padded FLOPs / useful FLOPs), and at equal lengths runs at >= "
             f"{EQUAL_TARGET:g}x the dense path. cuflash packed: cuflash.torch.attention(q, k, "
             f"v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=, max_seqlen_k=) "
             f"on (H, total, d) views of (total, H, d) tensors; padded / dense: "
             f"cuflash.torch.attention(q, k, v, causal=True) on (B, H, L, d) views of (B, L, H, "
             f"d). SDPA padded: F.scaled_dot_product_attention(is_causal=True, enable_gqa for "
             f"grouped heads) pinned to flash / cuDNN, no mask: with right padding a real query "
             f"sees only real keys, so real tokens' outputs are exact, and with dO zero on the "
             f"padding their gradients too (flash refuses masks). SDPA nested: the packed "
             f"tensors as jagged nested tensors (torch.nested.nested_tensor_from_jagged), "
             f"is_causal=True, torch's padding-free path; it trains only with k, v at the query "
             f"heads' count, so grouped k, v are repeated (repeat_interleave) inside the call. "
             f"fwd + bwd: out, then torch.autograd.grad(out, (q, k, v), dO).")
    return text
