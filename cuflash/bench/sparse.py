"""The block-sparse table: for each sparsity pattern of :mod:`cuflash.masks`, its density, the
time of block-sparse cuflash and its speedup over dense cuflash, with torch FlexAttention on
the same block mask as the peer column (when torch imports).

Shape: the speed table's harness (16k tokens per batch, hidden 2048) at each sequence length
of ``--sparse-seqlen`` (default 8192) and the first head dim of ``--hdims``, not causal, in each
mode of ``--modes``; one table per mode and length. Blocks are 128 x 128 (the masks' default), so the grid is seqlen / 128
blocks square. Patterns (their parameters scaled with the grid, n blocks a side, s =
isqrt(n)): dense (plain ``cuflash.attention``), butterfly(n), fixed(n, s, 1), strided(n, s),
local(n, 2), causal(n) and random(n, 0.1, seed 0).

cuflash runs ``cuflash.attention(q, k, v, block_mask=mask)`` (and ``attention_backward(...,
block_mask=mask)`` for the backward). When this build of cuflash has no such argument (its
signature lacks it, or the call raises TypeError naming it) the rows show a dash with the
footnote "block-sparse kernels not in this build"; dense cuflash still runs. When
:mod:`cuflash.masks` is missing, only the dense row is measured. FlexAttention runs
``torch.compile(flex_attention)`` with a ``BlockMask`` built from the same block table
(every present block a full block, no mask_mod), so the two columns compute the same thing.

Importing this module needs neither a GPU nor CuPy.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
from typing import Callable, Optional

from . import common
from .common import DASH, Footnotes
from .io import flops

DEFAULT_SEQLEN = 8192
NOT_IN_BUILD = "block-sparse kernels not in this build"
PEER = "flex"


# ---- patterns (no GPU) -------------------------------------------------------------------


def load_masks():
    """(cuflash.masks, None), or (None, reason) when it cannot be imported."""
    try:
        from cuflash import masks
    except Exception as exc:
        return None, f"cuflash.masks is not available ({common.first_line(exc)})"
    return masks, None


@dataclasses.dataclass
class Pattern:
    name: str  # as shown, e.g. "fixed(64, 8, 1)"
    kind: str  # the cuflash.masks function, or "dense"
    mask: object = None  # a cuflash.masks.BlockMask; None for dense
    density: Optional[float] = None
    error: Optional[str] = None  # why the mask could not be built


def pattern_specs(n_blocks: int) -> list:
    """(kind, positional arguments) of the patterns at a grid of n_blocks a side."""
    s = max(1, math.isqrt(n_blocks))
    return [("butterfly", (n_blocks,)), ("fixed", (n_blocks, s, 1)), ("strided", (n_blocks, s)),
            ("local", (n_blocks, 2)), ("causal", (n_blocks,)), ("random", (n_blocks, 0.1, 0))]


def build_patterns(n_blocks: int, masks=None) -> list:
    """Dense first, then every pattern of :func:`pattern_specs` built with cuflash.masks
    (each failure kept as the pattern's error). masks: the module, or None to import it."""
    patterns = [Pattern("dense", "dense", None, 1.0)]
    if masks is None:
        masks, reason = load_masks()
        if masks is None:
            return patterns
    for kind, params in pattern_specs(n_blocks):
        name = f"{kind}({', '.join(map(str, params))})"
        try:
            mask = getattr(masks, kind)(*params)
            patterns.append(Pattern(name, kind, mask, float(mask.density)))
        except Exception as exc:
            patterns.append(Pattern(name, kind, error=common.first_line(exc)))
    return patterns


def block_mask_supported(fn: Callable) -> bool:
    """Whether fn's signature has a block_mask parameter (True when it cannot be told)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "block_mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def is_missing_block_mask(exc: BaseException) -> bool:
    return isinstance(exc, TypeError) and "block_mask" in str(exc)


def sparse_shape(args, seqlen: int) -> tuple:
    return common.problem_shape(seqlen, args.hdims[0])


def sparse_names(args) -> list:
    return ["cuflash"] + ([PEER] if PEER in args.peers else [])


def count_steps(args) -> int:
    patterns = sum(1 + len(pattern_specs(max(1, seq // 128))) for seq in args.sparse_seqlen)
    return len(args.modes) * patterns * len(sparse_names(args))


# ---- measurement -------------------------------------------------------------------------


def _entry(ms=None, status="ok", error=None, times=None) -> dict:
    return {"ms": ms, "status": status, "error": error, "times_ms": times or []}


def _time(env, fn, sets, args, prepare=None) -> dict:
    """Time fn over the sets (prepare(*set) first, untimed); failures become entries."""
    try:
        if prepare is not None:
            sets = [prepare(*s) for s in sets]
            env.cupy.cuda.get_current_stream().synchronize()
        times, out = common.time_call(env.cupy, fn, sets, args.warmup, args.repeats)
        del out
        return _entry(statistics.median(times), times=times)
    except Exception as exc:
        if is_missing_block_mask(exc):
            return _entry(status="unavailable", error=NOT_IN_BUILD)
        return _entry(status="oom" if common.is_oom(env, exc) else "error",
                      error=common.first_line(exc))


def cuflash_case(mode: str, mask):
    """(fn, prepare) of cuflash on one pattern; mask None is dense (no block_mask argument),
    or (None, reason) when this build has no block_mask argument."""
    import cuflash

    extra = {} if mask is None else {"block_mask": mask}
    if mask is not None:
        needed = [cuflash.attention] + ([cuflash.attention_backward] if mode != "fwd" else [])
        if not all(block_mask_supported(f) for f in needed):
            return None, NOT_IN_BUILD
    if mode == "fwd":
        return (lambda q, k, v: cuflash.attention(q, k, v, **extra).o, None), None
    if mode == "bwd":
        def prepare(q, k, v, do):
            o, l, m = cuflash.attention(q, k, v, **extra)
            return do, q, k, v, o, l, m

        def run(do, q, k, v, o, l, m):
            return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, **extra))

        return (run, prepare), None

    def run_both(q, k, v, do):
        o, l, m = cuflash.attention(q, k, v, **extra)
        return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, **extra))

    return (run_both, None), None


_FLEX = None


def flex_function(torch):
    """torch.compile(flex_attention), made once."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_block_mask(torch, present, block_size, device="cuda"):
    """A FlexAttention BlockMask from a (Tq, Tk) boolean block table: every present block a
    full block (no mask_mod), indices padded to Tk so every pattern has the same shapes."""
    import numpy as np
    from torch.nn.attention.flex_attention import BlockMask

    present = np.asarray(present, dtype=bool)
    counts = present.sum(axis=-1).astype(np.int32)
    order = np.argsort(~present, axis=-1, kind="stable").astype(np.int32)  # present first
    full_num = torch.as_tensor(counts, device=device)[None, None]
    full_idx = torch.as_tensor(order, device=device)[None, None]
    return BlockMask.from_kv_blocks(torch.zeros_like(full_num), torch.zeros_like(full_idx),
                                    full_num, full_idx, BLOCK_SIZE=tuple(block_size),
                                    mask_mod=None)


def flex_case(env, mode: str, block_mask):
    torch = env.torch
    flex = flex_function(torch)
    if mode == "fwd":
        return (lambda q, k, v: flex(q, k, v, block_mask=block_mask), None)

    def leaves(q, k, v):
        return tuple(x.detach().requires_grad_() for x in (q, k, v))

    if mode == "bwd":
        def prepare(q, k, v, do):
            lq, lk, lv = leaves(q, k, v)
            return flex(lq, lk, lv, block_mask=block_mask), (lq, lk, lv), do

        def run(out, inputs, do):
            return torch.autograd.grad(out, inputs, do, retain_graph=True)

        return (run, prepare)

    def prepare_both(q, k, v, do):
        return leaves(q, k, v) + (do,)

    def run_both(q, k, v, do):
        out = flex(q, k, v, block_mask=block_mask)
        return torch.autograd.grad(out, (q, k, v), do)

    return (run_both, prepare_both)


def run_sparse(env, args, progress=None) -> list:
    """Every pattern in every mode at every length; returns the records."""
    progress = common.as_progress(progress)
    records = []
    for seqlen in args.sparse_seqlen:
        records += _run_length(env, args, seqlen, progress)
    return records


def _run_length(env, args, seqlen: int, progress) -> list:
    import numpy as np

    masks, masks_reason = load_masks()
    shape = sparse_shape(args, seqlen)
    batch, heads, seq, hdim = shape
    n_blocks = max(1, seq // 128)
    patterns = (build_patterns(n_blocks, masks) if masks is not None
                else [Pattern("dense", "dense", None, 1.0)])
    names = sparse_names(args)
    needs_do = any(m in ("bwd", "fwdbwd") for m in args.modes)
    set_bytes = 3 * math.prod(shape) * common.ITEMSIZE.get(env.dtype_name, 2)
    sets = common.make_inputs(env, shape, common.num_input_sets(set_bytes, env.l2_bytes),
                              4 if needs_do else 3)
    records = []
    for mode in args.modes:
        mode_sets = [s[:3] for s in sets] if mode == "fwd" else sets
        for pattern in patterns:
            record = {"table": "sparse", "mode": mode, "pattern": pattern.name,
                      "kind": pattern.kind, "density": pattern.density, "seqlen": seq,
                      "hdim": hdim, "batch": batch, "heads": heads, "dtype": env.dtype_name,
                      "causal": False, "block_size": 128,
                      "flops": (flops(seq, hdim, heads, batch, False, mode) * pattern.density
                                if pattern.density is not None else None),
                      "masks_reason": masks_reason, "backends": {}}
            for name in names:
                progress.start(f"sparse {mode} {seq} {pattern.name}: {name}")
                if pattern.error is not None:
                    entry = _entry(status="no mask", error=f"{pattern.name}: {pattern.error}")
                elif name == "cuflash":
                    case, reason = cuflash_case(mode, pattern.mask)
                    entry = (_entry(status="unavailable", error=reason) if case is None else
                             _time(env, case[0], mode_sets, args, case[1]))
                elif env.torch is None:
                    entry = _entry(status="unavailable", error=env.torch_reason)
                else:
                    try:
                        present = (np.ones((n_blocks, n_blocks), bool) if pattern.mask is None
                                   else pattern.mask.to_dense())
                        block = (128, 128) if pattern.mask is None else pattern.mask.block_size
                        fn, prepare = flex_case(env, mode, flex_block_mask(env.torch, present,
                                                                           block))
                        entry = _time(env, fn, mode_sets, args, prepare)
                    except Exception as exc:
                        entry = _entry(status="error", error=common.first_line(exc))
                record["backends"][name] = entry
                progress.advance()
                progress.note(f"sparse {mode} {seq} {pattern.name:>18} {name:>8}: " + (
                    f"{entry['ms']:.3f} ms" if entry["ms"] is not None else
                    f"{entry['status']}: {entry['error']}"))
                env.free_memory()
            records.append(record)
        del mode_sets
    del sets
    env.free_memory()
    return records


def cuflash_failures(records: list) -> list:
    """cuflash measurements that failed (not: a missing feature, a mask that cuflash.masks
    could not build)."""
    return [(f"sparse {r['mode']} {r['seqlen']} {r['pattern']}: cuflash", r["backends"]["cuflash"]["error"])
            for r in records
            if r["backends"].get("cuflash", {}).get("status") in ("error", "oom")]


# ---- report ------------------------------------------------------------------------------


def _ms(entry: Optional[dict], notes: Footnotes, name: str) -> str:
    if entry is None:
        return DASH
    if entry["ms"] is not None:
        return f"{entry['ms']:.3f}"
    if entry["status"] == "oom":
        return "OOM"
    if entry["error"] == NOT_IN_BUILD:
        return f"{DASH} {notes.mark(NOT_IN_BUILD)}"
    if name == "cuflash" and entry["status"] == "error":
        return f"FAILED {notes.mark('cuflash: ' + str(entry['error']))}"
    if entry["status"] == "no mask":
        return f"{DASH} {notes.mark(str(entry['error']))}"
    if name == PEER and entry["status"] == "unavailable":
        return f"{DASH} {notes.mark('FlexAttention: ' + str(entry['error']))}"
    return f"{DASH} {notes.mark(name + ': ' + str(entry['error']))}"


def _speedup(dense: Optional[dict], entry: Optional[dict]) -> str:
    if not dense or not entry or dense.get("ms") is None or entry.get("ms") is None:
        return DASH
    return f"{dense['ms'] / entry['ms']:.2f}x"


def format_sparse(records: list, args, notes: Footnotes) -> str:
    from .speed import MODE_NAMES

    names = sparse_names(args)
    blocks = []
    groups = dict.fromkeys((r["mode"], r["seqlen"]) for r in records)  # in run order
    for mode, seqlen in sorted(groups, key=lambda g: (args.modes.index(g[0]) if g[0] in args.modes else 99, g[1])):
        rows_of_mode = [r for r in records if r["mode"] == mode and r["seqlen"] == seqlen]
        dense = next((r for r in rows_of_mode if r["kind"] == "dense"), None)
        headers = ["pattern", "density", "cuflash ms", "cuflash vs dense"]
        if PEER in names:
            headers += ["flex ms", "flex vs dense", "cuflash / flex"]
        rows = []
        for r in rows_of_mode:
            density = f"{r['density']:.3f}" if r["density"] is not None else DASH
            mine = r["backends"].get("cuflash")
            row = [r["pattern"], density, _ms(mine, notes, "cuflash"),
                   _speedup(dense and dense["backends"].get("cuflash"), mine)]
            if PEER in names:
                theirs = r["backends"].get(PEER)
                row += [_ms(theirs, notes, PEER),
                        _speedup(dense and dense["backends"].get(PEER), theirs),
                        _speedup(theirs, mine)]
            rows.append(row)
        r0 = rows_of_mode[0]
        title = (f"block-sparse {MODE_NAMES[mode]}, seq {r0['seqlen']}, head dim {r0['hdim']}, "
                 f"{r0['batch']} x {r0['heads']} (batch x heads), {r0['dtype']}, blocks "
                 f"{r0['block_size']} x {r0['block_size']}, not causal")
        table = common.table(rows, headers, tablefmt=getattr(args, "tablefmt", "github"),
                         colalign=("left",) + ("right",) * (len(headers) - 1))
        blocks.append(common.wrap(title) + "\n\n" + table)
    text = "\n\n".join(blocks)
    reason = next((r["masks_reason"] for r in records if r.get("masks_reason")), None)
    if reason:
        text += f"\n\nonly the dense row: {reason}."
    text += "\n\n" + common.wrap(
        "density: fraction of the 128 x 128 blocks present; vs dense: dense time / pattern time "
        "of the same backend; cuflash / flex: flex time / cuflash time. cuflash: "
        "cuflash.attention(q, k, v, block_mask=mask) (dense: no block_mask); flex: "
        "torch.compile(flex_attention) with a BlockMask of the same blocks.")
    if notes.texts:
        text += "\n" + "\n".join(notes.lines())
    return text
