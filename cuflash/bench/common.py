"""What every table of the benchmark shares: the device environment, random inputs, timing,
the measured ceilings, footnotes and the progress bar.

Importing this module needs neither a GPU nor CuPy's CUDA libraries: CuPy and PyTorch are
imported inside the functions that use them.

Timing (:func:`time_call`): every call is timed on the GPU with its own pair of CUDA events,
after warm-up calls that absorb compilation, autotuning and allocator growth; consecutive calls
rotate among input sets whose total size exceeds twice the L2 cache, so no call reads what the
previous one left in L2; the median is reported. Inputs are standard normal random numbers,
never zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

PROG = "cuflash-bench"
TOKENS = 16384  # tokens per batch in the papers' harness
HIDDEN = 2048  # heads * head_dim
L2_BYTES = 60 * 10**6  # the H100/H200 L2; the device's own size is used when larger
WARMUP = 3
AUTO_TARGET_MS = 100.0  # adaptive repeats: about this much timed GPU work per measurement
AUTO_MIN_REPEATS = 10
AUTO_MAX_REPEATS = 100
# A call this slow (standard attention at 8k-16k: 0.1-1 s) is timed 3 times after one warm-up:
# its run-to-run spread is far below 1 %, and 14 calls of it would take most of the sweep.
SLOW_CALL_MS = 50.0
SLOW_REPEATS = 3
MATMUL_N = 8192
COPY_BYTES = 2 << 30
DASH = "\u2013"
# the default tables' labels of the peers (the JSON keeps the full names)
SHORT_NAMES = {"sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "sdpa_efficient": "efficient",
               "cuflash_torch": "cuflash.torch"}
CAPTION_WIDTH = 120  # titles, captions and footnotes wrap here; the default tables fit it too
REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bfloat16", "float16", "float32")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


# ---- pure helpers (no GPU) ---------------------------------------------------------------


def device_has_wgmma() -> bool:
    """Whether the current GPU runs cuflash's wgmma forward (False without a GPU)."""
    from cuflash import _config

    try:
        import cupy

        return _config.has_wgmma(cupy.cuda.Device().compute_capability)
    except Exception:  # no CuPy, driver or device: the mma.sync kernels are the ones described
        return False


def problem_shape(seq: int, hdim: int, tokens: int = TOKENS, hidden: int = HIDDEN) -> tuple:
    """(batch, heads, seq, hdim) of the papers' harness: batch = tokens // seq and
    heads = hidden // hdim, never below 1."""
    return (max(1, tokens // seq), max(1, hidden // hdim), seq, hdim)


def num_input_sets(set_bytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Input sets to rotate among: their total exceeds 2x L2, and never fewer than two."""
    return max(2, 2 * l2_bytes // max(1, set_bytes) + 1)


def auto_repeats(estimate_ms: float, target_ms: float = AUTO_TARGET_MS,
                 lo: int = AUTO_MIN_REPEATS, hi: int = AUTO_MAX_REPEATS) -> int:
    """Timed calls for a call of about estimate_ms: enough for ~target_ms, within [lo, hi]."""
    if not estimate_ms or estimate_ms <= 0 or not math.isfinite(estimate_ms):
        return hi
    if estimate_ms >= SLOW_CALL_MS:
        return SLOW_REPEATS
    return int(min(hi, max(lo, math.ceil(target_ms / estimate_ms))))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def wrap(text: str, width: int = CAPTION_WIDTH, indent: str = "") -> str:
    """Each line of text wrapped to width (continuations start with indent); words are never
    broken, so a long path or formula stays whole."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) if len(line) > width else line
                     for line in text.split("\n"))


def table(rows: list, headers: list, tablefmt: str = "github", colalign=None) -> str:
    """tabulate's table without its two spaces of header padding (at 10-20 columns that is what
    keeps a table inside CAPTION_WIDTH); cells are shown as given, never re-parsed as numbers."""
    import tabulate

    padding, tabulate.MIN_PADDING = tabulate.MIN_PADDING, 0
    try:
        return tabulate.tabulate(rows, headers, tablefmt=tablefmt, disable_numparse=True,
                                 colalign=colalign)
    finally:
        tabulate.MIN_PADDING = padding


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def git_commit(root: Path = REPO_ROOT) -> str:
    """The commit measured: $CUFLASH_COMMIT when set (a copy of the tree without .git), else
    git's HEAD of `root` (the directory holding the cuflash package) when `root` is the top of
    its own repository, with "+changes" when tracked files differ from it (a device copy whose
    .git is older than its files printed a commit that had not run), else "unknown": an
    installed package, or a tree copied into another repository, must not print that
    repository's commit."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"]

    def git(*argv) -> Optional[str]:
        try:
            done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True,
                                  timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        return "unknown"
    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    return head + "+changes" if git("status", "--porcelain", "--untracked-files=no") else head


class Footnotes:
    """Numbered footnotes, each text once."""

    def __init__(self):
        self.texts: list = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list:
        """One entry a footnote, wrapped to CAPTION_WIDTH with a hanging indent."""
        return [wrap(f"[{i}] {text}", indent="    ") for i, text in enumerate(self.texts, 1)]


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A progress bar on stderr, written by hand.

    ``start(label)`` names the measurement under way, ``advance()`` counts one done, and
    ``note(text)`` prints a result line. On a terminal the bar is redrawn in place under the
    notes; otherwise (a log file) only the notes are written, each prefixed with ``[done/total]``.
    """

    def __init__(self, total: int, stream=None, width: int = 24, tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total = max(0, int(total))
        self.done = 0
        self.label = ""
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.clock = clock
        self.t0 = clock()
        self._drawn = False

    def bar(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        frac = min(1.0, max(0.0, frac))
        filled = int(round(frac * self.width))
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{100 * frac:3.0f}% {format_duration(self.clock() - self.t0)}"
                + (f" {self.label}" if self.label else ""))

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.bar())
            self.stream.flush()
            self._drawn = True

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + "\n")
            self._draw()
        else:
            self.stream.write(f"[{self.done}/{self.total}] {text}\n")
            self.stream.flush()

    def clear(self) -> None:
        """Take the bar off the terminal (before the tables go to stdout); the next start,
        advance or note draws it again."""
        if self.tty and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class LineLog:
    """Progress's interface for callers that only want log lines with a fixed prefix."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def clear(self) -> None:
        pass

    def start(self, label: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def note(self, text: str) -> None:
        log(f"{self.prefix} {text}" if self.prefix else text)

    def close(self) -> None:
        pass


def as_progress(progress) -> Any:
    """A Progress-like object: the object itself, or a LineLog for a string prefix / None."""
    if progress is None or isinstance(progress, str):
        return LineLog(progress or "")
    return progress


# ---- the GPU environment -----------------------------------------------------------------


def require_device(prog: str = PROG):
    """Import CuPy and check for a device; exit 2 with one line saying why there is none
    (CuPy missing, with the extra that installs it; no driver; no device)."""
    from cuflash import _requirements

    reason = _requirements.gpu_unavailable()
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        raise SystemExit(2)
    import cupy

    return cupy


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
    if dtype in (cupy.float16, cupy.float32):
        return dtype, None
    try:
        a = cupy.ones((2, 16, 16), dtype=cupy.float32).astype(dtype)
        value = float(cupy.matmul(a, a).astype(cupy.float32)[1, 2, 3])
        if value != 16.0:
            raise ValueError(f"1 x 1 summed over 16 gave {value}")
        return dtype, None
    except Exception as exc:
        return cupy.float16, f"cupy.matmul refused bfloat16 ({first_line(exc)})"


_TORCH_STATE: Optional[tuple] = None


def setup_env(dtype_name: str, prog: str = PROG, use_torch: bool = True) -> Env:
    """The environment of one dtype; exits 2 with one line when there is no CUDA device.
    use_torch=False leaves PyTorch out (CuPy inputs, CuPy's stream)."""
    global _TORCH_STATE
    cupy = require_device(prog)
    if not use_torch:
        torch, torch_reason = None, "PyTorch left out"
    else:
        if _TORCH_STATE is None:
            _TORCH_STATE = load_torch()
        torch, torch_reason = _TORCH_STATE
    import ml_dtypes

    cupy_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": cupy.float16,
                  "float32": cupy.float32}[dtype_name]
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
        "memory_bytes": int(props.get("totalGlobalMem", 0)),
        "cuda_runtime": cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver": cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "cupy": cupy.__version__,
        "torch": env.torch.__version__ if env.torch is not None else None,
        "torch_reason": env.torch_reason,
        "commit": git_commit(),
        "inputs": env.input_source,
    }


# ---- compilation ---------------------------------------------------------------------------


def _build_variant(variant) -> str:
    from cuflash import _loader

    _loader.get_kernel(variant)
    return variant.key


def prebuild(variants: list, jobs: Optional[int] = None) -> int:
    """Compile kernel variants for the GPU at hand in parallel processes, into CuPy's disk
    cache, so that the warm-up calls load them instead of compiling one after another (as
    ``python -m cuflash.compile_check --warm`` does for every variant). Returns the count."""
    import concurrent.futures
    import multiprocessing

    unique = list({v.key: v for v in variants}.values())
    if not unique:
        return 0
    jobs = max(1, min(jobs or 16, os.cpu_count() or 1, len(unique)))
    context = multiprocessing.get_context("spawn")  # no CUDA state crosses a fork
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return len(list(pool.map(_build_variant, unique)))


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
    if env.dtype_name == "float32":
        return x
    if env.astype_bf16:
        return x.astype(env.cupy_dtype)
    return float32_to_bf16(env, x)


def make_inputs(env: Env, shape: tuple, count: int, tensors: int = 3) -> list:
    """`count` distinct sets of `tensors` random arrays of `shape` ((q, k, v) or (q, k, v, dO))."""
    return [tuple(random_tensor(env, shape) for _ in range(tensors)) for _ in range(count)]


def as_cupy(env: Env, x):
    return x if isinstance(x, env.cupy.ndarray) else env.cupy.from_dlpack(x)


def time_call(cupy, fn: Callable, input_sets: list, warmup: int = WARMUP,
              repeats: Optional[int] = None):
    """Milliseconds of each of `repeats` calls fn(*input_sets[i % n]) on the current stream.

    `warmup` untimed calls come first (compilation, autotuning, allocator growth), followed by
    a synchronization. With repeats None the count is adaptive: the second warm-up call is
    timed alone, repeats = auto_repeats(its time), and when it took SLOW_CALL_MS or more the
    remaining warm-ups are skipped. Each timed call has its own pair of events, recorded on
    the current stream around it. Returns (times, output of the first warm-up call).
    """
    n = len(input_sets)
    first = fn(*input_sets[0])
    offset, slow = 1, False
    if repeats is None:
        cupy.cuda.get_current_stream().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(*input_sets[1 % n])
        end.record()
        end.synchronize()
        estimate = cupy.cuda.get_elapsed_time(start, end)
        repeats, offset, slow = auto_repeats(estimate), 2, estimate >= SLOW_CALL_MS
    if not slow:
        for i in range(offset, warmup):
            fn(*input_sets[i % n])
        offset = max(offset, warmup)
    cupy.cuda.get_current_stream().synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    for i, (start, end) in enumerate(events):
        args = input_sets[(offset + i) % n]
        start.record()
        fn(*args)
        end.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(start, end) for start, end in events], first


def measure_ceilings(env: Env, repeats: Optional[int] = None) -> dict:
    """bf16 matmul rate (torch if present, else CuPy float16) and device copy bandwidth."""
    cupy = env.cupy
    n = MATMUL_N
    reps = min(repeats or 10, 10)
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
    times, _ = time_call(cupy, matmul, [(a, b)], WARMUP, reps)
    matmul_ms = statistics.median(times)
    del a, b

    src = cupy.empty(COPY_BYTES, dtype=cupy.uint8)
    src.fill(1)
    dst = cupy.empty_like(src)

    def copy(s, d):
        cupy.cuda.runtime.memcpyAsync(d.data.ptr, s.data.ptr, s.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    times, _ = time_call(cupy, copy, [(src, dst)], WARMUP, reps)
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


def ceilings_line(ceilings: dict) -> str:
    return (f"ceilings: matmul {ceilings['matmul_n']}^3 ({ceilings['matmul']}) "
            f"{ceilings['matmul_tflops']:.1f} TFLOP/s; device copy of "
            f"{ceilings['copy_bytes'] / 2**30:.0f} GiB {ceilings['copy_gbps']:.0f} GB/s "
            f"(read + write)")


def is_oom(env: Env, exc: BaseException) -> bool:
    if isinstance(exc, env.cupy.cuda.memory.OutOfMemoryError):
        return True
    return env.torch is not None and isinstance(exc, env.torch.cuda.OutOfMemoryError)
