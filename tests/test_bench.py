"""CPU tests of bench/bench_forward.py: FLOP count, shapes, argument parsing, report layout.

Nothing here needs a GPU; importing the benchmark module must not import CuPy.
"""

import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench import bench_forward as bf

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_flops_forward():
    # seq 1024, hdim 64: batch 16, heads 32
    assert bf.flops(1024, 64, 32, 16, causal=False) == 4 * 1024**2 * 64 * 32 * 16
    assert bf.flops(1024, 64, 32, 16, causal=True) == 2 * 1024**2 * 64 * 32 * 16
    assert bf.flops(3, 8, 1, 1, causal=False) == 4 * 9 * 8


def test_flops_grow_linearly_with_seqlen_in_the_harness():
    # 16k tokens per batch: doubling seq halves batch, so the FLOPs double.
    for hdim in (64, 128):
        counts = [bf.flops(s, hdim, *bf.problem_shape(s, hdim)[1::-1], causal=False)
                  for s in (1024, 2048, 4096)]
        assert counts[1] == 2 * counts[0] and counts[2] == 2 * counts[1]


def test_problem_shape():
    assert bf.problem_shape(1024, 64) == (16, 32, 1024, 64)
    assert bf.problem_shape(16384, 128) == (1, 16, 16384, 128)
    assert bf.problem_shape(32768, 64) == (1, 32, 32768, 64)  # never batch 0


def test_defaults():
    args = bf.parse_args([])
    assert args.seqlens == [1024, 2048, 4096, 8192, 16384]
    assert args.hdims == [64, 128]
    assert args.causal == "both" and args.causal_modes == [False, True]
    assert args.dtype == "bfloat16"
    assert args.repeats == 30 and args.warmup == 3
    assert args.tiles == [] and args.json is None
    assert args.peers == ["standard", "sdpa_flash", "sdpa_cudnn"]


def test_options():
    args = bf.parse_args([
        "--seqlens", "512", "2048", "--hdims", "128", "--causal", "yes", "--dtype", "float16",
        "--repeats", "5", "--json", "out.json", "--tiles", "128,64,8,1", "--tiles", "64, 32, 4, 2, 4",
        "--peers", "sdpa_flash",
    ])
    assert args.seqlens == [512, 2048] and args.hdims == [128]
    assert args.causal_modes == [True]
    assert args.dtype == "float16" and args.repeats == 5 and args.json == "out.json"
    assert args.tiles == [(128, 64, 8, 1), (64, 32, 4, 2, 4)]
    assert args.peers == ["sdpa_flash"]
    assert bf.parse_args(["--causal", "no"]).causal_modes == [False]


@pytest.mark.parametrize("argv", [
    ["--tiles", "128,60,8,1"],  # block_cols not a multiple of 16
    ["--tiles", "96,64,4,1"],  # block_rows not a multiple of 16 * warps
    ["--tiles", "128,64,8"],
    ["--tiles", "a,b,c,d"],
    ["--tiles", "128,64,8,0"],
    ["--causal", "maybe"],
    ["--dtype", "float32"],
    ["--repeats", "0"],
    ["--warmup", "0"],
    ["--seqlens", "0"],
    ["--peers", "xformers"],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bf.parse_args(argv)
    assert info.value.code == 2


def test_tile_label():
    assert bf.tile_label((128, 64, 1)) == "cuflash[128,64,1]"


def test_input_sets_exceed_twice_l2():
    l2 = 60 * 10**6
    for set_bytes in (1, 10**6, 10 * 10**6, 59 * 10**6, 120 * 10**6, 3 * 64 * 2**20):
        n = bf.num_input_sets(set_bytes, l2)
        assert n >= 2 and n * set_bytes > 2 * l2
        assert n == 2 or (n - 1) * set_bytes <= 2 * l2  # not more than needed


def test_footnotes_dedupe():
    notes = bf.Footnotes()
    assert notes.mark("a") == "[1]"
    assert notes.mark("b") == "[2]"
    assert notes.mark("a") == "[1]"
    assert notes.lines() == ["[1] a", "[2] b"]


def _entry(ms, flop, status="ok", error=None):
    return {"status": status, "error": error, "ms": ms, "times_ms": [ms] if ms else [],
            "tflops": flop / (ms * 1e-3) / 1e12 if ms else None, "dtype": "bfloat16"}


def test_report_layout():
    args = bf.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no",
                          "--tiles", "128,64,8,1"])
    flop = bf.flops(1024, 64, 32, 16, False)
    record = {"seqlen": 1024, "hdim": 64, "causal": False, "batch": 16, "heads": 32,
              "flops": flop, "backends": {
                  "cuflash": _entry(1.0, flop),
                  "cuflash[128,64,8,1]": _entry(1.25, flop),
                  "standard": _entry(None, flop, "oom", "OutOfMemoryError: x"),
                  "sdpa_flash": _entry(2.0, flop),
                  "sdpa_cudnn": _entry(None, flop, "error", "RuntimeError: No available kernel"),
              }}
    env = types.SimpleNamespace(standard_reason="cupy.matmul refused bfloat16 (TypeError: no)",
                                torch=None)
    notes = bf.Footnotes()
    text = bf.format_tables([record], args, {"matmul_tflops": 275.0}, env, notes)
    assert "cuflash ms" in text and "cuflash TFLOP/s" in text
    assert "cuflash[128,64,8,1] ms" in text and "standard (fp16) ms" in text
    assert "sdpa_flash TFLOP/s" in text and "sdpa_cudnn ms" in text
    assert "cuflash % of matmul peak" in text
    assert "cuflash / sdpa_flash" in text and "cuflash / sdpa_cudnn" in text
    assert "137.4" in text  # cuflash TFLOP/s
    assert "50.0%" in text  # of 275 TFLOP/s
    assert "2.00x" in text  # sdpa_flash time / cuflash time
    assert "OOM" in text
    assert "sdpa_cudnn: RuntimeError: No available kernel" in text
    assert "standard runs in float16" in text


def test_import_needs_no_cupy():
    code = "import sys, bench.bench_forward; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "bench.bench_forward", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--tiles" in out.stdout
