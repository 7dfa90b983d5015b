"""Forward and backward benchmark: cuflash against standard attention and PyTorch SDPA.

The harness of the FlashAttention papers: 16k tokens per batch (batch = 16384 // seqlen), hidden
size 2048 (heads = 2048 // head_dim), layout (batch, heads, seqlen, head_dim), random normal
inputs, forward FLOPs = 4 * seqlen^2 * head_dim * heads * batch (halved when causal), backward
FLOPs = 2.5 x forward FLOPs.

    python -m bench.bench_forward                       # the default sweep, bf16, fwd and bwd
    python -m bench.bench_forward --modes bwd --seqlens 4096 --hdims 128
    python -m bench.bench_forward --modes fwd --seqlens 4096 --hdims 128 --causal yes \\
        --tiles 128,64,8,1 --tiles 256,32,8,1,2        # tuning: one column per tile entry

The backward rows time the backward alone, from the same q, k, v and a fixed random dO: the
forward whose results it needs runs once per input set before the timing. cuflash:
cuflash.attention_backward(do, q, k, v, o, l, m). SDPA: torch.autograd.grad(out, (q, k, v), dO,
retain_graph=True) on a graph recorded once. Standard: an explicit CuPy backward from the P the
standard forward materialised (dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
dQ = scale dS K, dK = scale dS^T Q).

Tables go to stdout, progress to stderr, raw numbers to --json FILE. Every call is timed on the
GPU with its own pair of CUDA events, on PyTorch's current stream when PyTorch is present (so that
cuflash, which launches on CuPy's current stream, and SDPA are ordered the same way), after
warm-up calls that absorb every compilation. Consecutive calls rotate among input sets whose
total size exceeds twice the L2 cache.

Importing this module needs neither a GPU nor CuPy's CUDA libraries (the tests parse arguments
and count FLOPs on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

TOKENS = 16384  # tokens per batch
HIDDEN = 2048  # heads * head_dim
L2_BYTES = 60 * 10**6  # the H100/H200 L2; the device's own size is used when larger
WARMUP = 3
REPEATS = 30
DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128)
MODES = ("fwd", "bwd")
MODE_NAMES = {"fwd": "forward", "bwd": "backward"}
BWD_FLOP_FACTOR = 2.5  # backward FLOPs per forward FLOP (five matmuls against two, as in FA2)
PEERS = ("standard", "sdpa_flash", "sdpa_cudnn")
SDPA_PEERS = ("sdpa_flash", "sdpa_cudnn")
MATMUL_N = 8192
COPY_BYTES = 2 << 30
CHECK_WARN = 0.05  # max |o - o_peer| above which the progress line flags the check
DASH = "\u2013"
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---- pure helpers (no GPU) ---------------------------------------------------------------


def flops(seq: int, hdim: int, heads: int, batch: int, causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention. Forward: two matmuls of 2 * seq^2 * hdim each, per head and batch,
    halved when causal. Backward ("bwd"): 2.5 times the forward's."""
    total = 4 * seq * seq * hdim * heads * batch
    total = total / 2 if causal else float(total)
    if mode == "bwd":
        return BWD_FLOP_FACTOR * total
    if mode != "fwd":
        raise ValueError(f"mode must be 'fwd' or 'bwd', got {mode!r}")
    return total


def problem_shape(seq: int, hdim: int, tokens: int = TOKENS, hidden: int = HIDDEN) -> tuple:
    """(batch, heads, seq, hdim) of the papers' harness."""
    return (max(1, tokens // seq), max(1, hidden // hdim), seq, hdim)


def parse_tiles(text: str) -> tuple:
    """'BR,BC,W,MB[,U]' -> a tile-table entry of cuflash._config (block_rows, block_cols,
    warps, min_blocks[, qk_unroll]), checked against the kernel's rules."""
    try:
        tiles = tuple(int(p) for p in text.replace(" ", "").split(","))
    except ValueError:
        tiles = ()
    if len(tiles) not in (4, 5):
        raise argparse.ArgumentTypeError(
            f"tiles must be 4 or 5 integers 'BR,BC,W,MB[,U]', got {text!r}")
    br, bc, warps, mb = tiles[:4]
    if warps < 1 or br % (16 * warps):
        raise argparse.ArgumentTypeError(
            f"block_rows must be a multiple of 16 * warps, got {br} rows, {warps} warps")
    if bc <= 0 or bc % 16:
        raise argparse.ArgumentTypeError(
            f"block_cols must be a positive multiple of 16, got {bc} in {text!r}")
    if mb < 1:
        raise argparse.ArgumentTypeError(f"min_blocks must be at least 1, got {mb} in {text!r}")
    return tiles


def tile_label(tiles: tuple) -> str:
    return "cuflash[" + ",".join(map(str, tiles)) + "]"


def causal_modes(choice: str) -> list:
    return {"no": [False], "yes": [True], "both": [False, True]}[choice]


def num_input_sets(set_bytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Input sets to rotate among: their total exceeds 2x L2, and never fewer than two."""
    return max(2, 2 * l2_bytes // max(1, set_bytes) + 1)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_forward",
        description="Forward and backward speed of cuflash against standard attention (CuPy) "
                    "and PyTorch SDPA (flash, cuDNN), in the FlashAttention papers' harness: "
                    f"{TOKENS} tokens per batch, hidden {HIDDEN}, layout (batch, heads, seq, hdim).",
    )
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS),
                        metavar="N", help="sequence lengths (default: %(default)s)")
    parser.add_argument("--hdims", type=int, nargs="+", default=list(DEFAULT_HDIMS),
                        metavar="D", help="head dims (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="fwd: forward pass; bwd: backward pass alone (default: both)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both",
                        help="causal masking (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="input dtype (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed calls per measurement; the median is reported "
                             "(default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="untimed calls first; compilation happens here (default: %(default)s)")
    parser.add_argument("--tiles", type=parse_tiles, action="append", default=[],
                        metavar="BR,BC,MB",
                        help="tuning mode: add a column cuflash[BR,BC,MB] run with these forward "
                             "tiles for the head-dim bucket under test (repeatable; forward "
                             "tables only)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help="peer backends to run (default: all)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    parser.add_argument("--tablefmt", default="github",
                        help="tabulate table format (default: %(default)s)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seqlens", "hdims"):
        bad = [x for x in getattr(args, name) if x <= 0]
        if bad:
            parser.error(f"--{name} must be positive, got {bad}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (compilation must not be timed)")
    args.causal_modes = causal_modes(args.causal)
    args.modes = [m for m in MODES if m in args.modes]  # canonical order, no repeats
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def git_commit() -> str:
    """The commit measured: $CUFLASH_COMMIT when set (the device copy has no .git), else git's."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


class Footnotes:
    """Numbered footnotes, each text once."""

    def __init__(self):
        self.texts: list = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list:
        return [f"[{i}] {text}" for i, text in enumerate(self.texts, 1)]


# ---- the GPU environment -----------------------------------------------------------------


@dataclasses.dataclass
class Env:
    cupy: Any
    torch: Any  # None when PyTorch is not usable
    torch_reason: Optional[str]  # why not
    dtype_name: str
    cupy_dtype: Any
    torch_dtype: Any
    standard_dtype: Any  # the dtype the standard path computes in
    standard_reason: Optional[str]  # why it is not dtype_name
    astype_bf16: bool  # whether CuPy converts float32 -> bfloat16 itself
    l2_bytes: int

    def stream(self):
        """Run on PyTorch's current stream when PyTorch is present, else CuPy's."""
        if self.torch is None:
            return contextlib.nullcontext()
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.cupy.cuda.ExternalStream(self.torch.cuda.current_stream().cuda_stream)

    @property
    def input_source(self) -> str:
        if self.torch is not None:
            return "torch.randn"
        if self.astype_bf16:
            return "cupy.random.standard_normal + astype"
        return "cupy.random.standard_normal + float32->bfloat16 rounding kernel"

    def free_memory(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()


def require_device():
    """Import CuPy and check for a device; exit 1 with one clear line if there is none."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no CUDA libraries: the same for the user
        count = 0
    if count == 0:
        print("no CUDA device found", file=sys.stderr)
        raise SystemExit(1)
    return cupy


def load_torch():
    """(torch, None) or (None, reason)."""
    try:
        import torch
    except Exception as exc:
        return None, f"PyTorch is not available ({first_line(exc)})"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} sees no CUDA device"
    return torch, None


def cupy_astype_bf16(cupy, bf16) -> bool:
    try:
        x = cupy.arange(4, dtype=cupy.float32).astype(bf16)
        return bool((x.view(cupy.uint16).get() == [0, 0x3F80, 0x4000, 0x4040]).all())
    except Exception:
        return False


def probe_standard_dtype(cupy, dtype):
    """The dtype cupy.matmul takes for the standard path: dtype itself, or float16 + reason."""
    if dtype == cupy.float16:
        return dtype, None
    try:
        a = cupy.ones((2, 16, 16), dtype=cupy.float32).astype(dtype)
        value = float(cupy.matmul(a, a).astype(cupy.float32)[1, 2, 3])
        if value != 16.0:
            raise ValueError(f"1 x 1 summed over 16 gave {value}")
        return dtype, None
    except Exception as exc:
        return cupy.float16, f"cupy.matmul refused bfloat16 ({first_line(exc)})"


def setup_env(dtype_name: str) -> Env:
    cupy = require_device()
    torch, torch_reason = load_torch()
    import ml_dtypes

    cupy_dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else cupy.float16
    torch_dtype = getattr(torch, dtype_name) if torch is not None else None
    astype_bf16 = dtype_name != "bfloat16" or cupy_astype_bf16(cupy, cupy_dtype)
    standard_dtype, standard_reason = probe_standard_dtype(cupy, cupy_dtype)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return Env(cupy, torch, torch_reason, dtype_name, cupy_dtype, torch_dtype, standard_dtype,
               standard_reason, astype_bf16, max(L2_BYTES, int(props.get("l2CacheSize", 0))))


def cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def device_info(env: Env) -> dict:
    cupy = env.cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "sms": props.get("multiProcessorCount"),
        "l2_mb": props.get("l2CacheSize", 0) / 1e6,
        "cuda_runtime": cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver": cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "cupy": cupy.__version__,
        "torch": env.torch.__version__ if env.torch is not None else None,
        "torch_reason": env.torch_reason,
        "commit": git_commit(),
        "inputs": env.input_source,
    }


# ---- inputs and timing -------------------------------------------------------------------


_BF16_BITS_KERNEL = None


def float32_to_bf16(env: Env, x):
    """Round-to-nearest-even float32 -> bfloat16 on the GPU, for CuPy builds without astype."""
    global _BF16_BITS_KERNEL
    cupy = env.cupy
    if _BF16_BITS_KERNEL is None:
        _BF16_BITS_KERNEL = cupy.ElementwiseKernel(
            "float32 x", "uint16 y",
            "unsigned int b = __float_as_uint(x);"
            " b += 0x7fffu + ((b >> 16) & 1u);"
            " y = (unsigned short)(b >> 16);",
            "bench_float32_to_bf16_bits")
    return _BF16_BITS_KERNEL(x).view(env.cupy_dtype)


def random_tensor(env: Env, shape: tuple):
    """Standard normal values in the benchmark dtype: a torch tensor when torch is present."""
    if env.torch is not None:
        return env.torch.randn(shape, device="cuda", dtype=env.torch_dtype)
    x = env.cupy.random.standard_normal(shape, dtype=env.cupy.float32)
    if env.astype_bf16:
        return x.astype(env.cupy_dtype)
    return float32_to_bf16(env, x)


def make_inputs(env: Env, shape: tuple, count: int) -> list:
    """`count` distinct (q, k, v) sets of `shape`."""
    return [tuple(random_tensor(env, shape) for _ in range(3)) for _ in range(count)]


def as_cupy(env: Env, x):
    return x if isinstance(x, env.cupy.ndarray) else env.cupy.from_dlpack(x)


def time_call(cupy, fn: Callable, input_sets: list, warmup: int = WARMUP, repeats: int = REPEATS):
    """Milliseconds of each of `repeats` calls fn(*input_sets[i % n]) on the current stream.

    `warmup` untimed calls come first (compilation, autotuning, allocator growth), followed by
    a synchronization. Each timed call has its own pair of events. Returns (times, output of the
    first warm-up call).
    """
    n = len(input_sets)
    first = fn(*input_sets[0])
    for i in range(1, warmup):
        fn(*input_sets[i % n])
    cupy.cuda.get_current_stream().synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    for i, (start, end) in enumerate(events):
        args = input_sets[(warmup + i) % n]
        start.record()
        fn(*args)
        end.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(start, end) for start, end in events], first


def measure_ceilings(env: Env, repeats: int) -> dict:
    """bf16 matmul rate (torch if present, else CuPy float16) and device copy bandwidth."""
    cupy = env.cupy
    n = MATMUL_N
    if env.torch is not None:
        torch = env.torch
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        how = "torch bfloat16"
        matmul = torch.matmul
    else:
        a, b = (cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
                for _ in range(2))
        how = "cupy float16"
        matmul = cupy.matmul
    times, _ = time_call(cupy, matmul, [(a, b)], WARMUP, min(repeats, 10))
    matmul_ms = statistics.median(times)
    del a, b

    src = cupy.empty(COPY_BYTES, dtype=cupy.uint8)
    src.fill(1)
    dst = cupy.empty_like(src)

    def copy(s, d):
        cupy.cuda.runtime.memcpyAsync(d.data.ptr, s.data.ptr, s.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    times, _ = time_call(cupy, copy, [(src, dst)], WARMUP, min(repeats, 10))
    copy_ms = statistics.median(times)
    del src, dst
    env.free_memory()
    return {
        "matmul": how,
        "matmul_n": n,
        "matmul_ms": matmul_ms,
        "matmul_tflops": 2 * n**3 / (matmul_ms * 1e-3) / 1e12,
        "copy_bytes": COPY_BYTES,
        "copy_ms": copy_ms,
        "copy_gbps": 2 * COPY_BYTES / (copy_ms * 1e-3) / 1e9,
    }


# ---- backends ----------------------------------------------------------------------------


@dataclasses.dataclass
class Backend:
    name: str
    fn: Callable  # fn(*args) -> output; args: an input set, or what prepare made of it
    context: Callable = contextlib.nullcontext  # entered around all calls
    convert: Optional[Callable] = None  # applied to each input outside the timing
    prepare: Optional[Callable] = None  # prepare(*input_set) -> args of fn, untimed
    max_sets: Optional[int] = None  # use at most this many input sets
    is_cuflash: bool = False
    tiles: Optional[tuple] = None


def cuflash_backend(causal: bool, hdim: int, tiles: Optional[tuple] = None) -> Backend:
    import cuflash
    from cuflash import _config

    def run(q, k, v):
        return cuflash.attention(q, k, v, causal=causal).o

    if tiles is None:
        return Backend("cuflash", run, is_cuflash=True)
    bucket = _config.head_dim_bucket(hdim)
    return Backend(tile_label(tiles), run,
                   context=lambda: _config.forward_tiles_override({bucket: tiles}),
                   is_cuflash=True, tiles=tiles)


def cuflash_backward_backend(causal: bool) -> Backend:
    """Times cuflash.attention_backward; o, l, m come from a forward run while preparing."""
    import cuflash

    def prepare(q, k, v, do):
        o, l, m = cuflash.attention(q, k, v, causal=causal)
        return do, q, k, v, o, l, m

    def run(do, q, k, v, o, l, m):
        return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal))

    return Backend("cuflash", run, prepare=prepare, is_cuflash=True)


def standard_parts(env: Env, causal: bool, nq: int, nk: int, hdim: int):
    """(forward, backward) of standard attention in CuPy, in env.standard_dtype.

    forward(q, k, v) -> (o, p): S = q k^T * scale, causal -inf mask, float32 softmax, P cast
    back to the input dtype and kept, o = P v. backward(q, k, v, do, o, p) -> (dq, dk, dv) from
    that P, nothing recomputed: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) in
    float32 then cast back, dQ = scale dS K, dK = scale dS^T Q.
    """
    cupy = env.cupy
    scale = 1.0 / math.sqrt(hdim)
    bias = None
    if causal:  # 0 where allowed, -inf where key j > query i + (nk - nq); built untimed
        rows = cupy.arange(nq)[:, None]
        cols = cupy.arange(nk)[None, :]
        bias = cupy.where(cols > rows + (nk - nq), cupy.float32(-cupy.inf), cupy.float32(0))

    def forward(q, k, v):
        s = cupy.matmul(q, k.swapaxes(-1, -2))
        s32 = s.astype(cupy.float32)
        del s
        s32 *= scale
        if bias is not None:
            s32 += bias
        s32 -= s32.max(axis=-1, keepdims=True)
        cupy.exp(s32, out=s32)
        s32 /= s32.sum(axis=-1, keepdims=True)
        p = s32.astype(q.dtype)
        del s32
        return cupy.matmul(p, v), p

    def backward(q, k, v, do, o, p):
        dv = cupy.matmul(p.swapaxes(-1, -2), do)
        dp = cupy.matmul(do, v.swapaxes(-1, -2))
        delta = (do.astype(cupy.float32) * o.astype(cupy.float32)).sum(axis=-1, keepdims=True)
        ds32 = dp.astype(cupy.float32)
        del dp
        ds32 -= delta
        ds32 *= p
        ds32 *= scale
        ds = ds32.astype(q.dtype)
        del ds32
        return cupy.matmul(ds, k), cupy.matmul(ds.swapaxes(-1, -2), q), dv

    return forward, backward


def standard_convert(env: Env) -> Callable:
    def convert(x):
        x = as_cupy(env, x)
        return x if x.dtype == env.standard_dtype else x.astype(env.standard_dtype)
    return convert


def standard_backend(env: Env, causal: bool, nq: int, nk: int, hdim: int) -> Backend:
    """The forward of standard_parts, all in CuPy."""
    forward, _ = standard_parts(env, causal, nq, nk, hdim)

    def run(q, k, v):
        return forward(q, k, v)[0]

    return Backend("standard", run, convert=standard_convert(env))


def standard_backward_backend(env: Env, causal: bool, nq: int, nk: int, hdim: int) -> Backend:
    """The backward of standard_parts from a materialised P. One input set only: P is
    batch * heads * seq^2 elements, far beyond any L2, and a second one may not fit."""
    forward, backward = standard_parts(env, causal, nq, nk, hdim)

    def prepare(q, k, v, do):
        o, p = forward(q, k, v)
        return q, k, v, do, o, p

    return Backend("standard", backward, convert=standard_convert(env), prepare=prepare,
                   max_sets=1)


SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def sdpa_backend(env: Env, name: str, causal: bool) -> Backend:
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_BACKENDS[name])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v):
        return sdpa(q, k, v, is_causal=causal)

    return Backend(name, run, context=lambda: sdpa_kernel(which))


def sdpa_backward_backend(env: Env, name: str, causal: bool) -> Backend:
    """Times torch.autograd.grad of SDPA's output with a fixed dO, on a graph recorded once
    per input set while preparing (the backend choice is made by the forward)."""
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_BACKENDS[name])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def prepare(q, k, v, do):
        leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(which):
            out = sdpa(*leaves, is_causal=causal)
        return out, leaves, do

    def run(out, leaves, do):
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    return Backend(name, run, prepare=prepare)


def peer_backend(env: Env, name: str, causal: bool, shape: tuple, mode: str = "fwd") -> Backend:
    if name == "standard":
        parts = standard_backend if mode == "fwd" else standard_backward_backend
        return parts(env, causal, shape[2], shape[2], shape[3])
    if mode == "fwd":
        return sdpa_backend(env, name, causal)
    return sdpa_backward_backend(env, name, causal)


# ---- measurements ------------------------------------------------------------------------


@dataclasses.dataclass
class Measurement:
    times_ms: list = dataclasses.field(default_factory=list)
    status: str = "ok"  # ok | oom | error | unavailable
    error: Optional[str] = None
    dtype: Optional[str] = None

    @property
    def ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms else None


def run_backend(env: Env, backend: Backend, input_sets: list, warmup: int, repeats: int):
    """Time one backend on the input sets; returns (Measurement, first output)."""
    sets = input_sets[:backend.max_sets] if backend.max_sets else input_sets
    if backend.convert is not None:
        sets = [tuple(backend.convert(x) for x in s) for s in sets]
    dtype = str(getattr(sets[0][0], "dtype", "")).replace("torch.", "")
    with backend.context():
        if backend.prepare is not None:
            sets = [backend.prepare(*s) for s in sets]
            env.cupy.cuda.get_current_stream().synchronize()
        times, first = time_call(env.cupy, backend.fn, sets, warmup, repeats)
    return Measurement(times, dtype=dtype), first


def is_oom(env: Env, exc: BaseException) -> bool:
    if isinstance(exc, env.cupy.cuda.memory.OutOfMemoryError):
        return True
    return env.torch is not None and isinstance(exc, env.torch.cuda.OutOfMemoryError)


def run_peer(env: Env, name: str, causal: bool, shape: tuple, input_sets, warmup, repeats,
             mode: str = "fwd"):
    """A peer never stops the benchmark: its failure becomes an OOM or error Measurement."""
    if name in SDPA_PEERS and env.torch is None:
        return Measurement(status="unavailable", error=env.torch_reason), None
    try:
        backend = peer_backend(env, name, causal, shape, mode)
        return run_backend(env, backend, input_sets, warmup, repeats)
    except Exception as exc:
        failed = Measurement(status="oom" if is_oom(env, exc) else "error",
                             error=first_line(exc))
    env.free_memory()  # after the except block, whose traceback held the failed call's arrays
    return failed, None


def max_abs_diff(env: Env, a, b) -> Optional[float]:
    try:
        cupy = env.cupy
        x = as_cupy(env, a).astype(cupy.float32)
        y = as_cupy(env, b).astype(cupy.float32)
        return float(cupy.abs(x - y).max())
    except Exception as exc:
        log(f"  check failed: {first_line(exc)}")
        return None


def max_rel_diff(env: Env, reference: tuple, other: tuple) -> Optional[float]:
    """max over the gradients (dq, dk, dv) of max|other - reference| / max|reference|."""
    try:
        cupy = env.cupy
        worst = 0.0
        for a, b in zip(reference, other):
            x = as_cupy(env, a).astype(cupy.float32)
            y = as_cupy(env, b).astype(cupy.float32)
            worst = max(worst, float(cupy.abs(x - y).max()) / max(float(cupy.abs(x).max()), 1e-30))
        return worst
    except Exception as exc:
        log(f"  check failed: {first_line(exc)}")
        return None


def backend_names(args, mode: str) -> list:
    """Columns of one mode: the tile-override columns tune forward tiles, so fwd only."""
    tiles = [tile_label(t) for t in args.tiles] if mode == "fwd" else []
    return ["cuflash"] + tiles + list(args.peers)


def run_config(env: Env, args, hdim: int, seq: int, causal: bool, input_sets, progress,
               mode: str = "fwd") -> dict:
    """Every backend on one (mode, hdim, seq, causal); returns the JSON record.

    input_sets: (q, k, v) tuples for fwd, (q, k, v, dO) for bwd."""
    shape = problem_shape(seq, hdim)
    batch, heads = shape[0], shape[1]
    record = {"mode": mode, "seqlen": seq, "hdim": hdim, "causal": causal, "batch": batch,
              "heads": heads, "dtype": env.dtype_name,
              "flops": flops(seq, hdim, heads, batch, causal, mode), "backends": {}}
    check_key = "max_abs_diff_vs_cuflash" if mode == "fwd" else "max_rel_grad_diff_vs_cuflash"
    record[check_key] = {}
    reference = None
    tiles_by_name = {tile_label(t): t for t in args.tiles}
    for name in backend_names(args, mode):
        if name == "cuflash" or name in tiles_by_name:  # cuflash errors propagate
            if mode == "fwd":
                backend = cuflash_backend(causal, hdim, tiles_by_name.get(name))
            else:
                backend = cuflash_backward_backend(causal)
            result, out = run_backend(env, backend, input_sets, args.warmup, args.repeats)
        else:
            result, out = run_peer(env, name, causal, shape, input_sets, args.warmup,
                                   args.repeats, mode)
        entry = {"status": result.status, "error": result.error, "dtype": result.dtype,
                 "ms": result.ms, "times_ms": result.times_ms,
                 "tflops": record["flops"] / (result.ms * 1e-3) / 1e12 if result.ms else None}
        record["backends"][name] = entry
        note = ""
        if reference is None:
            reference = out
        elif out is not None:
            if mode == "fwd":
                diff = max_abs_diff(env, reference, out)
                what = "max|o - o_cuflash|"
            else:
                diff = max_rel_diff(env, reference, out)
                what = "max|d - d_cuflash| / max|d_cuflash| over dq, dk, dv"
            record[check_key][name] = diff
            if diff is not None:
                note = f", {what} = {diff:.2e}" + (" (LARGE)" if diff > CHECK_WARN else "")
        del out
        if result.ms is not None:
            log(f"{progress} {name:>16}: {result.ms:8.3f} ms {entry['tflops']:7.1f} TFLOP/s{note}")
        else:
            log(f"{progress} {name:>16}: {result.status}: {result.error}")
        env.free_memory()
    del reference
    return record


def run_all(env: Env, args) -> list:
    records = []
    total = len(args.modes) * len(args.hdims) * len(args.seqlens) * len(args.causal_modes)
    done = 0
    for hdim in args.hdims:
        for seq in args.seqlens:
            shape = problem_shape(seq, hdim)
            set_bytes = 3 * math.prod(shape) * 2
            count = num_input_sets(set_bytes, env.l2_bytes)
            input_sets = make_inputs(env, shape, count)
            if "bwd" in args.modes:  # a fixed dO per input set, the same for every backend
                input_sets = [s + (random_tensor(env, shape),) for s in input_sets]
            for mode in args.modes:
                sets = [s[:3] for s in input_sets] if mode == "fwd" else input_sets
                for causal in args.causal_modes:
                    done += 1
                    progress = (f"[{done}/{total}] {mode} hdim {hdim} seq {seq} causal "
                                f"{'yes' if causal else 'no'}")
                    log(f"{progress}: shape {shape}, {count} input sets")
                    records.append(run_config(env, args, hdim, seq, causal, sets, progress,
                                              mode))
                del sets
            del input_sets
            env.free_memory()
    return records


# ---- report ------------------------------------------------------------------------------


def header_lines(info: dict, args) -> list:
    torch = info["torch"] or f"{DASH} ({info['torch_reason']})"
    return [
        f"GPU: {info['gpu']} ({info['sms']} SMs, L2 {info['l2_mb']:.0f} MB), CUDA runtime "
        f"{info['cuda_runtime']}, driver {info['cuda_driver']}",
        f"cuflash commit {info['commit']}, cupy {info['cupy']}, torch {torch}",
        f"{' and '.join(MODE_NAMES[m] for m in getattr(args, 'modes', ['fwd']))}, "
        f"{args.dtype}, {TOKENS} tokens per batch, hidden {HIDDEN}, layout "
        f"(batch, heads, seq, hdim), inputs from {info['inputs']}; median of {args.repeats} "
        f"calls after {args.warmup} warm-up",
    ]


def ceilings_line(ceilings: dict) -> str:
    return (f"ceilings: matmul {ceilings['matmul_n']}^3 ({ceilings['matmul']}) "
            f"{ceilings['matmul_tflops']:.1f} TFLOP/s; device copy of "
            f"{ceilings['copy_bytes'] / 2**30:.0f} GiB {ceilings['copy_gbps']:.0f} GB/s "
            f"(read + write)")


def time_cells(entry: Optional[dict], notes: Footnotes, name: str) -> list:
    """[ms, TFLOP/s] cells of one backend."""
    if entry is None:
        return [DASH, DASH]
    if entry["status"] == "oom":
        return ["OOM", "OOM"]
    if entry["status"] == "unavailable":
        return [f"{DASH} {notes.mark('PyTorch SDPA columns: ' + entry['error'])}", DASH]
    if entry["ms"] is None:
        return [f"{DASH} {notes.mark(name + ': ' + entry['error'])}", DASH]
    return [f"{entry['ms']:.3f}", f"{entry['tflops']:.1f}"]


def ratio_cell(entries: dict, peer: str) -> str:
    mine, theirs = entries.get("cuflash"), entries.get(peer)
    if not mine or not theirs or mine["ms"] is None or theirs["ms"] is None:
        return DASH
    return f"{theirs['ms'] / mine['ms']:.2f}x"


def format_tables(records: list, args, ceilings: dict, env: Env, notes: Footnotes) -> str:
    from tabulate import tabulate

    modes = getattr(args, "modes", ["fwd"])
    all_names = ["cuflash"] + [tile_label(t) for t in args.tiles] + list(args.peers)
    labels = dict(zip(all_names, all_names))
    if "standard" in all_names and env.standard_reason:
        labels["standard"] = "standard (fp16)"
        notes.mark(f"standard runs in float16: {env.standard_reason}")
    ratio_peers = [p for p in SDPA_PEERS if p in all_names]

    blocks = []
    for mode in modes:
        names = backend_names(args, mode)
        headers = ["seqlen", "batch x heads"]
        for name in names:
            headers += [f"{labels[name]} ms", f"{labels[name]} TFLOP/s"]
        headers.append("cuflash % of matmul peak")
        headers += [f"cuflash / {p}" for p in ratio_peers]
        for causal in args.causal_modes:
            for hdim in args.hdims:
                rows = []
                for r in records:
                    if (r.get("mode", "fwd") != mode or r["causal"] != causal
                            or r["hdim"] != hdim):
                        continue
                    row = [r["seqlen"], f"{r['batch']} x {r['heads']}"]
                    for name in names:
                        row += time_cells(r["backends"].get(name), notes, name)
                    tf = r["backends"]["cuflash"]["tflops"]
                    row.append(f"{100 * tf / ceilings['matmul_tflops']:.1f}%")
                    row += [ratio_cell(r["backends"], p) for p in ratio_peers]
                    rows.append(row)
                title = (f"{MODE_NAMES[mode]}, causal={'yes' if causal else 'no'}, "
                         f"head dim {hdim}, {args.dtype}")
                table = tabulate(rows, headers, tablefmt=args.tablefmt, disable_numparse=True,
                                 colalign=("right",) * len(headers))
                blocks.append(title + "\n\n" + table)
    text = "\n\n".join(blocks)
    text += ("\n\nms: median time of one call; TFLOP/s: forward 4 * seqlen^2 * hdim * heads * "
             "batch (halved when causal) / time")
    if "bwd" in modes:
        text += f", backward {BWD_FLOP_FACTOR:g} x that / time"
    text += "; cuflash / peer: peer time / cuflash time."
    if "bwd" in modes:
        text += ("\nbackward: the backward pass alone, with a fixed random dO, after a forward "
                 "run untimed: cuflash.attention_backward(do, q, k, v, o, l, m); SDPA "
                 "torch.autograd.grad(out, (q, k, v), dO, retain_graph=True)")
        if "standard" in args.peers:
            text += ("; standard: an explicit CuPy backward from the P the standard forward "
                     "kept (dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) in float32 "
                     "cast back, dQ = scale dS K, dK = scale dS^T Q), one input set")
        if args.tiles:
            text += "; the cuflash[...] tile columns tune forward tiles and appear in forward tables only"
        text += "."
    if notes.texts:
        text += "\n" + "\n".join(notes.lines())
    return text


def write_json(path: str, info: dict, ceilings: dict, records: list, args, env, notes) -> None:
    data = {
        "info": info,
        "settings": {"modes": list(args.modes), "dtype": args.dtype, "tokens": TOKENS,
                     "hidden": HIDDEN, "bwd_flop_factor": BWD_FLOP_FACTOR,
                     "warmup": args.warmup, "repeats": args.repeats,
                     "tiles": [list(t) for t in args.tiles], "peers": list(args.peers),
                     "standard_dtype": str(env.cupy.dtype(env.standard_dtype)),
                     "standard_reason": env.standard_reason, "inputs": env.input_source},
        "ceilings": ceilings,
        "results": records,
        "footnotes": notes.texts,
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    env = setup_env(args.dtype)
    notes = Footnotes()
    with env.stream():
        info = device_info(env)
        print("\n".join(header_lines(info, args)), flush=True)
        log("measuring ceilings (matmul, copy)")
        ceilings = measure_ceilings(env, args.repeats)
        print(ceilings_line(ceilings) + "\n", flush=True)
        records = run_all(env, args)
    print(format_tables(records, args, ceilings, env, notes), flush=True)
    if args.json:
        write_json(args.json, info, ceilings, records, args, env, notes)
        log(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
