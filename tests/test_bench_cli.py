"""CPU tests of cuflash-bench (cuflash.bench): FLOP and byte counting, argument parsing, table
layout from fake measurements, CSV / JSON / plot writing, timing bookkeeping, the progress
bar, and the command's behaviour without a GPU.

Nothing here needs a GPU. The subprocess tests hide any GPU (CUDA_VISIBLE_DEVICES=""), so they
take the no-device path on a GPU machine too.
"""

import csv
import json
import math
import os
import shutil
import subprocess
import sys
import types
from io import StringIO
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_gpu
from cpu_fakes import NumpyAsCupy
from cuflash import reference as ref
from cuflash.bench import cli, common, decode, e2e, host, io, memory, sparse, speed, varlen

REPO_ROOT = Path(__file__).resolve().parent.parent
NO_GPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")
GPT2 = dict(n=1024, d=64, heads=16, batch=64)
HB = 16 * 64  # heads * batch of GPT-2 medium


def flat(text: str) -> str:
    """text with its captions' line wraps undone (every run of whitespace one space)."""
    return " ".join(text.split())


def run_cli(*argv, cwd=REPO_ROOT, module="bench"):
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=NO_GPU_ENV,
                          capture_output=True, text=True, timeout=120)


# ---- FLOPs -------------------------------------------------------------------------------


def test_flops_forward_backward_and_causal():
    fwd = 4 * 1024**2 * 64 * 32 * 16
    assert io.flops(1024, 64, 32, 16, False) == fwd
    assert io.flops(1024, 64, 32, 16, True) == fwd / 2
    assert io.flops(1024, 64, 32, 16, False, "bwd") == 2.5 * fwd
    assert io.flops(1024, 64, 32, 16, True, "bwd") == 2.5 * fwd / 2
    assert io.flops(1024, 64, 32, 16, False, "fwdbwd") == 3.5 * fwd
    assert io.flops(1024, 64, 32, 16, True, "fwdbwd") == 3.5 * fwd / 2
    assert speed.flops is io.flops  # the speed table counts the same way
    with pytest.raises(ValueError, match="mode"):
        io.flops(8, 8, 1, 1, False, "both")


def test_standard_flops_keep_p():
    fwd = io.flops(1024, 64, 16, 64, False)
    assert io.standard_flops(1024, 64, 16, 64, False, "fwd") == fwd
    assert io.standard_flops(1024, 64, 16, 64, False, "bwd") == 2 * fwd  # four matmuls
    assert io.standard_flops(1024, 64, 16, 64, False, "fwdbwd") == 3 * fwd
    assert io.standard_flops(1024, 64, 16, 64, True, "fwdbwd") == 1.5 * fwd
    # GPT-2 medium, forward + backward: 12 N^2 d per head (standard), 14 N^2 d (flash)
    assert io.standard_flops(**dict(seq=1024, hdim=64, heads=16, batch=64)) == 12 * 1024**2 * 64 * HB
    assert io.flops(1024, 64, 16, 64, False, "fwdbwd") == 14 * 1024**2 * 64 * HB


# ---- bytes -------------------------------------------------------------------------------


def test_standard_bytes_gpt2_medium_by_hand():
    n, d = 1024, 64
    fwd = io.standard_traffic(n, d, 16, 64, mode="fwd")
    # read Q, K, V (3 N d) and S, P (2 N^2); write S, P (2 N^2) and O (N d); 2 bytes each
    assert fwd.read == (3 * n * d + 2 * n * n) * 2 * HB == 4_587_520 * HB
    assert fwd.write == (n * d + 2 * n * n) * 2 * HB == 4_325_376 * HB
    bwd = io.standard_traffic(n, d, 16, 64, mode="bwd")
    assert bwd.read == (5 * n * n + 5 * n * d) * 2 * HB == 11_141_120 * HB
    assert bwd.write == (2 * n * n + 3 * n * d) * 2 * HB == 4_587_520 * HB
    both = io.standard_traffic(n, d, 16, 64)
    assert both == fwd + bwd
    assert both.total == 25_232_932_864
    quadratic = 11 * n * n * 2 * HB
    assert quadratic / both.total > 0.9  # the N^2 terms dominate
    assert both.total - quadratic == 12 * n * d * 2 * HB


def test_standard_bytes_grow_quadratically_and_take_score_itemsize():
    small = io.standard_traffic(8192, 64).total
    large = io.standard_traffic(16384, 64).total
    assert 3.9 < large / small <= 4
    wide = io.standard_traffic(1024, 64, score_itemsize=4, mode="fwd")
    assert wide.read == 3 * 1024 * 64 * 2 + 2 * 1024**2 * 4
    with pytest.raises(ValueError, match="mode"):
        io.standard_traffic(1024, 64, mode="both")
    with pytest.raises(ValueError, match="positive"):
        io.standard_traffic(0, 64)


def test_flash_forward_bytes_by_hand():
    n, d = 1024, 64
    t = io.flash_forward_traffic(n, d, 16, 64, br=128, bc=64)
    # Q once, K and V once per query tile (1024 / 128 = 8 passes), O, l, m written once
    assert t.read == (n * d * 2 + 8 * 2 * n * d * 2) * HB == 2_228_224 * HB
    assert t.write == (n * d * 2 + 2 * n * 4) * HB == 139_264 * HB
    # causal: query tile i loads keys up to its last row: 128 (i + 1), 8 tiles
    c = io.flash_forward_traffic(n, d, br=128, bc=64, causal=True)
    assert c.read == n * d * 2 + 2 * (128 * 36) * d * 2
    ragged = io.flash_forward_traffic(1000, d, br=128, bc=64)
    assert ragged.read == 1000 * d * 2 + 8 * 2 * 1000 * d * 2


def test_flash_bytes_fall_as_br_grows():
    totals = [io.flash_forward_traffic(1024, 64, 16, 64, br=br, bc=64).total
              for br in (16, 32, 64, 128, 256, 512)]
    assert all(a > b for a, b in zip(totals, totals[1:]))
    # the K/V part (all but Q in, O, l, m out) halves with each doubling of Br
    fixed = (2 * 1024 * 64 * 2 + 2 * 1024 * 4) * HB
    kv = [t - fixed for t in totals]
    assert all(a == 2 * b for a, b in zip(kv, kv[1:]))
    sweep = io.analytical_io()["sweep"]
    rows = [r["analytical"]["read"] + r["analytical"]["write"] for r in sweep]
    assert [r["br"] for r in sweep] == sorted(r["br"] for r in sweep)
    assert all(a > b for a, b in zip(rows, rows[1:]))
    assert [r["kv_passes"] for r in sweep] == [1024 // r["br"] for r in sweep]


def test_flash_backward_bytes_by_hand():
    n, d = 1024, 64
    t = io.flash_backward_traffic(n, d, br=64, bc=128)
    rows = 8 * n  # 8 key tiles, each visiting every query row
    read = (2 * n * d * 2 + 2 * n * 4  # preprocess: dO, O, l, m
            + 2 * n * d * 2  # K, V once
            + rows * (2 * d * 2 + 3 * 4)  # Q, dO, (m, log2 l), D per visited row
            + rows * 4 * d  # dQ atomics (read)
            + 4 * n * d)  # cast dQ
    write = 4 * n * d + 3 * n * 4 + rows * 4 * d + 2 * n * d * 2 + n * d * 2
    assert (t.read, t.write) == (read, write) == (5_087_232, 2_764_800)
    causal = io.flash_backward_traffic(n, d, br=64, bc=128, causal=True)
    visited = sum(n - 128 * j for j in range(8))  # key tile j starts at query tile 2j
    assert causal.read == read - (rows - visited) * (2 * d * 2 + 12 + 4 * d)
    # head dims above 128: the key pass runs twice (dV, then dK), reading Q, dO, K, V again
    wide = io.flash_backward_traffic(n, 256, br=16, bc=128)
    assert wide == io.flash_backward_traffic(n, 256, br=16, bc=128, key_passes=2)
    one = io.flash_backward_traffic(n, 256, br=16, bc=128, key_passes=1)
    assert wide.read - one.read == 2 * n * 256 * 2 + 8 * n * (2 * 256 * 2 + 12)
    assert wide.write == one.write


def test_flash_between_lower_bound_and_standard():
    from cuflash import _config

    tiles = io.cuflash_tiles("bfloat16", 64)
    variant = _config.forward_config("bfloat16", 64, 64, False, wgmma=common.device_has_wgmma())
    assert tiles["fwd"] == (variant.block_rows, variant.block_cols)
    hopper = _config.forward_config("bfloat16", 64, 64, False, wgmma=True)
    assert io.cuflash_tiles("bfloat16", 64, wgmma=True)["fwd"] == (hopper.block_rows, hopper.block_cols)
    key_pass = _config.backward_plan("bfloat16", 64, 64, False, False, wgmma=common.device_has_wgmma()).key_passes[0]
    assert tiles["bwd"] == (key_pass.block_rows, key_pass.block_cols)
    flash = io.flash_traffic(1024, 64, 16, 64, fwd_tiles=tiles["fwd"], bwd_tiles=tiles["bwd"])
    low = io.compulsory_traffic(1024, 64, 16, 64)
    std = io.standard_traffic(1024, 64, 16, 64)
    assert low.total < flash.total < std.total
    assert low.total == (3 + 1 + 5 + 3) * 1024 * 64 * 2 * HB + 4 * 1024 * 4 * HB
    assert io.flash_traffic(1024, 64, fwd_tiles=(128, 64), bwd_tiles=(64, 128), mode="fwd") == \
        io.flash_forward_traffic(1024, 64, br=128, bc=64)


def test_theorem2_order_n2_d2_over_m():
    d, n = 64, 4096
    assert io.theorem2_tiles(d, 4 * d * 64) == (64, 64)
    assert io.theorem2_tiles(d, 4 * d * 16) == (16, 16)
    assert io.theorem2_tiles(d, 4 * d * 256) == (64, 256)  # Br = min(Bc, d)
    once = 2 * n * d * 2  # K, V read once

    def excess(m, n=n):
        br, bc = io.theorem2_tiles(d, m)
        return io.algorithm1_traffic(n, d, br=br, bc=bc).total - 2 * n * d * 2

    m = 4 * d * 64
    assert excess(m) == pytest.approx(4 * excess(4 * m))  # 1 / M
    assert excess(m, 2 * n) == pytest.approx(4 * excess(m, n))  # N^2
    # Theta(N^2 d^2 / M): the constant is 12 s + 64 / d (Q, O in and O out, l, m)
    assert excess(m) == pytest.approx((12 * 2 + 64 / d) * n * n * d * d / m)
    assert once > 0


def test_traffic_helpers():
    t = io.Traffic(3, 4)
    assert t.total == 7 and t + io.Traffic(1, 1) == io.Traffic(4, 5)
    assert t.scaled(3) == io.Traffic(9, 12)


# ---- ncu -----------------------------------------------------------------------------------

DETAILS_CSV = '''==PROF== Connected to process 123
program output
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python","h","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000,000"
"0","123","python","h","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","250000"
"1","123","python","h","flash_bwd_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","2.5"
"1","123","python","h","flash_bwd_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","500"
==PROF== Disconnected from process 123
'''

RAW_CSV = '''"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"
"","","byte","Mbyte"
"0","a","100","1"
"1","b","200","2"
'''


def test_parse_ncu_csv_details_and_raw():
    got = io.parse_ncu_csv(DETAILS_CSV)
    assert got == {"read": 1_000_000 + 2_500_000, "write": 250_000 + 500_000, "kernels": 2}
    assert io.parse_ncu_csv(RAW_CSV) == {"read": 300, "write": 3_000_000, "kernels": 2}
    with pytest.raises(ValueError, match="header"):
        io.parse_ncu_csv("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="unit"):
        io.parse_ncu_csv(DETAILS_CSV.replace('"Mbyte"', '"furlong"'))


def test_ncu_command():
    cmd = io.ncu_command("/usr/bin/ncu", "/tmp/x.csv", {"method": "cuflash", "mode": "fwd"})
    assert cmd[0] == "/usr/bin/ncu"
    assert "dram__bytes_read.sum,dram__bytes_write.sum" in cmd
    assert cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert cmd[cmd.index("--log-file") + 1] == "/tmp/x.csv"
    assert cmd[-4:-1] == ["-m", "cuflash.bench.io", "--probe"]
    assert json.loads(cmd[-1]) == {"method": "cuflash", "mode": "fwd"}


def test_run_ncu_reports_failure(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - no permission' >&2\nexit 1\n")
    fake.chmod(0o755)
    got = io.run_ncu({"method": "cuflash"}, str(fake))
    assert got["status"] == "error" and "ERR_NVGPUCTRPERM" in got["error"]
    got = io.run_ncu({"method": "cuflash"}, str(tmp_path / "missing"))
    assert got["status"] == "error" and "did not run" in got["error"]


# ---- arguments -----------------------------------------------------------------------------


def test_defaults():
    args = cli.parse_args([])
    assert args.tables == ["speed", "memory", "io", "sparse", "decode", "varlen", "host", "e2e"]
    assert not args.wide
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.hdims == [64, 128] and args.dtypes == ["bfloat16"]
    assert args.causal == "both" and args.causal_modes == [False, True]
    assert args.modes == ["fwd", "bwd", "fwdbwd"]
    assert args.peers == ["standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
    assert not args.io and args.json is None and args.csv is None and args.plot is None
    assert args.repeats is None and args.warmup == 3 and args.tiles == []
    assert args.memory_seqlens == [2048, 4096, 8192, 16384, 32768, 65536]
    assert args.sparse_seqlen == [8192] and args.tablefmt == "github"


def test_every_option(tmp_path):
    args = cli.parse_args([
        "--tables", "sparse", "io", "speed", "--seqlens", "4096", "1024", "4096",
        "--hdims", "128", "64", "--dtypes", "float16", "bfloat16", "--causal", "yes",
        "--modes", "fwdbwd", "fwd", "--peers", "flex", "sdpa_cudnn", "--io",
        "--memory-seqlens", "8192", "1024", "--sparse-seqlen", "4096", "--repeats", "7",
        "--warmup", "2", "--tiles", "128,64,4,1", "--json", str(tmp_path / "a.json"),
        "--csv", str(tmp_path / "a.csv"), "--tablefmt", "plain"])
    assert args.tables == ["speed", "io", "sparse"]  # canonical order
    assert args.seqlens == [1024, 4096] and args.hdims == [128, 64]
    assert args.dtypes == ["float16", "bfloat16"] and args.causal_modes == [True]
    assert args.modes == ["fwd", "fwdbwd"] and args.peers == ["sdpa_cudnn", "flex"]
    assert args.io and args.memory_seqlens == [1024, 8192] and args.sparse_seqlen == [4096]
    assert args.repeats == 7 and args.warmup == 2 and args.tiles == [(128, 64, 4, 1)]
    assert args.json.endswith("a.json") and args.csv.endswith("a.csv")
    assert args.tablefmt == "plain"
    assert cli.parse_args(["--peers"]).peers == []
    assert cli.parse_args(["--causal", "no"]).causal_modes == [False]


@pytest.mark.parametrize("argv, message", [
    (["--seqlens", "0"], "positive integer"),
    (["--seqlens", "x"], "positive integer"),
    (["--hdims", "100"], "multiples of 8"),
    (["--hdims", "512"], "multiples of 8"),
    (["--dtypes", "int8"], "invalid choice"),
    (["--causal", "maybe"], "invalid choice"),
    (["--modes", "both"], "invalid choice"),
    (["--modes"], "expected at least one"),
    (["--peers", "xformers"], "invalid choice"),
    (["--tables", "graphs"], "invalid choice"),
    (["--repeats", "0"], "positive integer"),
    (["--warmup", "0"], "positive integer"),
    (["--sparse-seqlen", "1000"], "128 times a power of two"),
    (["--sparse-seqlen", "384"], "128 times a power of two"),
    (["--tiles", "128,60,4,1"], "multiple of 16"),
    (["--io", "--tables", "speed"], "add io to --tables"),
    (["--plot", "x.png", "--tables", "io"], "add speed to --tables"),
    (["--json", "/nonexistent/folder/x.json"], "does not exist"),
    (["--csv", "/nonexistent/folder/x.csv"], "does not exist"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_needs_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "matplotlib_missing", lambda: "ModuleNotFoundError: matplotlib")
    with pytest.raises(SystemExit):
        cli.parse_args(["--plot", str(tmp_path / "p.png")])
    assert "pip install 'cuflash[plot]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "matplotlib_missing", lambda: None)
    assert cli.parse_args(["--plot", str(tmp_path / "p.png")]).plot.endswith("p.png")


def test_step_counts():
    args = cli.parse_args(["--seqlens", "1024", "2048", "--hdims", "64", "--causal", "no",
                           "--modes", "fwd", "fwdbwd", "--peers", "sdpa_flash", "flex"])
    assert speed.count_steps(args) == 2 * 2 * 2  # 2 seqlens x 2 modes x (cuflash + sdpa_flash)
    margs = cli.memory_args(args)
    assert margs.hdim == 64 and margs.heads == 32 and margs.peers == ["sdpa_flash"]
    assert memory.count_steps(margs) == 6 * 2
    assert sparse.count_steps(args) == 2 * 7 * 2  # 2 modes x 7 patterns x (cuflash + flex)
    assert io.count_steps(args) == 2 + len(io.SWEEP_TILES)
    assert host.count_steps(args) == len(host.CASES) == 12
    assert e2e.count_steps(args) == 7 * 7  # shapes x (4 torch + 3 JAX backends)
    assert varlen.count_steps() == 2 * 2 * (6 + 2 * 2)  # heads x modes x (mixed + 2 equal batches)
    assert cli.count_steps(args) == (1 + 8 + 12 + 6 + 28 + decode.count_steps() + varlen.count_steps()
                                     + 12 + 49)


# ---- timing and progress -----------------------------------------------------------------


class _FakeCupy:
    """Events whose elapsed time is fixed; records which input set each call received."""

    def __init__(self, elapsed_ms=5.0):
        self.elapsed = elapsed_ms
        stream = types.SimpleNamespace(synchronize=lambda: None)

        class Event:
            def record(self):
                pass

            def synchronize(self):
                pass

        self.cuda = types.SimpleNamespace(
            Event=Event, get_current_stream=lambda: stream,
            get_elapsed_time=lambda a, b: self.elapsed)


def test_time_call_warms_up_rotates_and_adapts():
    cupy = _FakeCupy(5.0)
    seen = []
    sets = [("a",), ("b",), ("c",)]
    times, first = common.time_call(cupy, lambda x: seen.append(x) or x, sets, 3, None)
    # 3 warm-up calls (the first compiles, the second is timed as the probe) + ceil(100 / 5)
    assert first == "a" and len(times) == 20 and len(seen) == 23
    assert seen[:6] == ["a", "b", "c", "a", "b", "c"]  # rotation through the sets
    slow = []  # a probe over SLOW_CALL_MS: no third warm-up, SLOW_REPEATS timed calls
    times, _ = common.time_call(_FakeCupy(200.0), lambda x: slow.append(x), sets, 3, None)
    assert len(times) == common.SLOW_REPEATS and len(slow) == 2 + common.SLOW_REPEATS
    fixed = []  # a given repeat count needs no probe: exactly warmup + repeats calls
    times, _ = common.time_call(cupy, lambda x: fixed.append(x), sets, 1, 4)
    assert len(times) == 4 and len(fixed) == 5
    assert common.auto_repeats(0.01) == common.AUTO_MAX_REPEATS
    assert common.auto_repeats(1000.0) == common.SLOW_REPEATS
    assert common.auto_repeats(common.SLOW_CALL_MS * 0.99) == common.AUTO_MIN_REPEATS
    assert common.auto_repeats(float("nan")) == common.AUTO_MAX_REPEATS


def test_progress_bar_terminal_and_log():
    clock = iter([0.0, 65.0, 65.0, 65.0, 65.0, 65.0, 65.0])
    out = StringIO()
    bar = common.Progress(4, stream=out, width=8, tty=True, clock=lambda: next(clock))
    bar.start("speed fwd")
    bar.advance()
    bar.note("result line")
    bar.clear()
    bar.close()
    text = out.getvalue()
    assert "[##......] 1/4  25% 1:05 speed fwd" in text
    assert "\r\033[Kresult line\n" in text
    assert text.count("\n") == 1
    log = StringIO()
    lines = common.Progress(2, stream=log, tty=False)
    lines.start("x")
    lines.advance()
    lines.note("done one")
    lines.close()
    assert log.getvalue() == "[1/2] done one\n"
    assert common.format_duration(3599) == "59:59"


# ---- speed table layout ------------------------------------------------------------------


def _entry(ms, flop, status="ok", error=None):
    return {"status": status, "error": error, "ms": ms, "times_ms": [ms] if ms else [],
            "tflops": flop / (ms * 1e-3) / 1e12 if ms else None, "dtype": "bfloat16"}


def _speed_records(dtypes=("bfloat16",)):
    records = []
    for dtype in dtypes:
        for mode, ms in (("fwd", 1.0), ("bwd", 2.0), ("fwdbwd", 3.0)):
            flop = io.flops(1024, 64, 32, 16, False, mode)
            records.append({
                "mode": mode, "seqlen": 1024, "hdim": 64, "causal": False, "batch": 16,
                "heads": 32, "dtype": dtype, "flops": flop, "backends": {
                    "cuflash": _entry(ms, flop),
                    "standard": _entry(None, flop, "oom", "OutOfMemoryError: x"),
                    "sdpa_flash": _entry(2 * ms, flop),
                    "sdpa_cudnn": _entry(ms / 2, flop),
                    "sdpa_efficient": _entry(None, flop, "unavailable", "PyTorch sees no CUDA device"),
                }})
    return records


def test_speed_tables_layout():
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no", "--wide"])
    notes = common.Footnotes()
    text = speed.format_tables(_speed_records(), args, {"matmul_tflops": 275.0}, None, notes)
    for title in ("forward, causal=no, head dim 64, bfloat16",
                  "backward, causal=no, head dim 64, bfloat16",
                  "forward + backward, causal=no, head dim 64, bfloat16"):
        assert title in text
    header = next(line for line in text.splitlines() if line.startswith("| ") and "seqlen" in line)
    for column in ("cuflash ms", "cuflash TFLOP/s", "standard ms", "sdpa_flash TFLOP/s",
                   "sdpa_cudnn ms", "sdpa_efficient ms", "cuflash % of matmul peak",
                   "cuflash / standard", "cuflash / sdpa_flash", "cuflash / sdpa_cudnn",
                   "cuflash / sdpa_efficient"):
        assert column in header
    assert "137.4" in text and "50.0%" in text  # 137.4 TFLOP/s of 275
    assert "2.00x" in text and "0.50x" in text and "OOM" in text
    assert "[1] PyTorch SDPA columns: PyTorch sees no CUDA device" in text
    assert "forward + backward 3.5 x that" in flat(text)
    assert text.count("[1]") >= 4  # one footnote, referenced in every table


def test_speed_tables_cuflash_failure_and_dtypes():
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no",
                           "--dtypes", "bfloat16", "float16", "--modes", "fwd",
                           "--peers", "standard", "--wide"])
    records = _speed_records(("bfloat16", "float16"))
    records = [r for r in records if r["mode"] == "fwd"]
    records[1]["backends"]["cuflash"] = _entry(None, 1, "error", "CUDADriverError: boom")
    env = {"bfloat16": types.SimpleNamespace(standard_reason="cupy.matmul refused bfloat16"),
           "float16": types.SimpleNamespace(standard_reason=None)}
    notes = common.Footnotes()
    text = speed.format_tables(records, args, {"matmul_tflops": 275.0}, env, notes)
    assert "head dim 64, bfloat16" in text and "head dim 64, float16" in text
    assert "standard (fp16) ms" in text and "standard runs in float16" in text
    assert "FAILED [" in text and "cuflash: CUDADriverError: boom" in text
    assert speed.cuflash_failures(records) == [
        ("speed fwd float16 hdim 64 seq 1024 causal no: cuflash", "CUDADriverError: boom")]


def test_run_config_fwdbwd_plumbing(monkeypatch):
    """fwdbwd end to end on a CPU: cuflash stood in for by the float64 reference, the standard
    peer's real code on NumPy, SDPA unavailable, a cuflash failure recorded not raised."""
    env = types.SimpleNamespace(cupy=NumpyAsCupy(), torch=None, torch_reason="no torch here",
                                dtype_name="float32", standard_dtype=np.dtype(np.float32),
                                free_memory=lambda: None)

    def fake_time_call(cupy, fn, input_sets, warmup, repeats):
        return [1.0] * (repeats or 10), fn(*input_sets[0])

    def reference_fwdbwd(causal):
        def run(q, k, v, do):
            return ref.standard_attention_backward(do, q, k, v, causal=causal)
        return speed.Backend("cuflash", run, is_cuflash=True)

    monkeypatch.setattr(speed, "time_call", fake_time_call)
    monkeypatch.setattr(speed, "cuflash_fwdbwd_backend", reference_fwdbwd)
    args = cli.parse_args(["--modes", "fwdbwd", "--peers", "standard", "sdpa_efficient"])
    rng = np.random.default_rng(1)
    sets = [tuple(rng.standard_normal((1, 2, 32, 16)).astype(np.float32) for _ in range(4))
            for _ in range(2)]
    record = speed.run_config(env, args, 16, 32, True, sets, "[test]", "fwdbwd")
    assert record["flops"] == io.flops(32, 16, 128, 512, True, "fwdbwd")
    assert list(record["backends"]) == ["cuflash", "standard", "sdpa_efficient"]
    assert record["backends"]["standard"]["ms"] == 1.0
    assert record["backends"]["sdpa_efficient"]["status"] == "unavailable"
    assert record["max_rel_grad_diff_vs_cuflash"]["standard"] < 1e-4

    def broken(causal):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(speed, "cuflash_fwdbwd_backend", broken)
    record = speed.run_config(env, args, 16, 32, False, sets, "[test]", "fwdbwd")
    assert record["backends"]["cuflash"]["status"] == "error"
    assert "kernel exploded" in record["backends"]["cuflash"]["error"]
    assert len(speed.cuflash_failures([record])) == 1


# ---- memory table ------------------------------------------------------------------------


def _memory_records():
    def ok(nbytes):
        return {"status": "ok", "error": None, "peak_bytes": nbytes, "retained_bytes": nbytes}
    records = []
    for seq in (4096, 8192, 16384, 32768):
        outputs = 4 * memory.tensor_bytes(seq, 128, 16, 1)
        standard = ok(16 * 2**20 * (seq // 4096) ** 2) if seq < 32768 else {
            "status": "oom", "error": None, "peak_bytes": None}
        records.append({"seqlen": seq, "batch": 1, "heads": 16, "hdim": 128, "causal": False,
                        "dtype": "bfloat16", "outputs_bytes": outputs, "inputs_bytes": outputs,
                        "backends": {"cuflash": ok(outputs + 2**20 * seq // 4096),
                                     "sdpa_flash": ok(2 * outputs),
                                     "sdpa_efficient": {"status": "unavailable", "peak_bytes": None,
                                                        "error": "no torch"},
                                     "standard": standard}})
    return records


def test_memory_table_shows_growth_and_oom_point():
    margs = memory.memory_args([4096, 8192, 16384, 32768], 128,
                               peers=["sdpa_flash", "sdpa_efficient", "standard", "flex"])
    assert margs.heads == 16 and margs.peers == ["sdpa_flash", "sdpa_efficient", "standard"]
    text = memory.format_table(_memory_records(), margs, common.Footnotes(),
                               device_bytes=141 * 2**30)
    assert "cuflash MiB" in text and "standard MiB" in text and "efficient MiB" in text
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    text = flat(text)
    assert "growth, cuflash: 4096->8192 (2x seq): x2.00 (linear)" in text
    assert "growth, standard: 4096->8192 (2x seq): x4.00 (quadratic)" in text
    assert "standard attention runs out of memory from seq 32768 on (the longest that ran: 16384)" in text
    n_full = math.sqrt(141 * 2**30 / (16 * 6))
    assert f"at N = {n_full:.0f}" in text and "16 x 1 x N^2 x 6 bytes" in text
    assert "PyTorch columns: no torch" in text


# ---- io table ----------------------------------------------------------------------------


def test_io_table_analytical():
    result = io.analytical_io("bfloat16")
    assert result["shape"] == {"seq": 1024, "hdim": 64, "heads": 16, "batch": 64}
    notes = common.Footnotes()
    text = io.format_io(result, notes, no_gpu_reason=cli.NO_GPU_RUNTIME)
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    text = flat(text)
    assert "IO: GPT-2 medium attention, forward + backward" in text
    assert "bytes: analytical count" in text and "(ncu)" not in text
    assert "| GFLOP" in text and "824.6" in text  # 12 N^2 d x 1024 heads
    assert "25.23" in text  # standard, read + write, GB
    assert "runtime ms" in text and f"[1] {cli.NO_GPU_RUNTIME}" in text
    assert "66.6 GFLOPs, 40.3 GB" in text  # the paper's numbers, for reference
    assert "Br x Bc (warps)" in text and "K/V passes" in text
    for tiles in io.SWEEP_TILES:
        assert f"{tiles[0]} x {tiles[1]} ({tiles[2]})" in text


def test_io_table_measured():
    result = io.analytical_io("bfloat16")
    result["bytes_source"] = "ncu"
    result["methods"]["standard"].update(ms=40.0, status="ok",
                                         ncu={"status": "ok", "read": 30e9, "write": 12e9})
    result["methods"]["cuflash"].update(ms=5.0, status="ok",
                                        ncu={"status": "error", "error": "ncu failed: ERR_NVGPUCTRPERM"})
    for k, row in enumerate(result["sweep"]):
        row.update(ms=1.0 + k, status="ok", ncu={"status": "ok", "read": 2e9, "write": 1e8})
    text = flat(io.format_io(result, common.Footnotes()))
    assert "bytes: measured by ncu" in text
    assert "read + write GB (ncu)" in text and "42.00" in text
    assert "ncu failed: ERR_NVGPUCTRPERM" in text
    assert "40.00" in text and "5.00" in text
    assert "2.10" in text  # sweep row, ncu read + write


# ---- block-sparse table ------------------------------------------------------------------


def test_patterns_from_masks():
    patterns = sparse.build_patterns(64)
    names = [p.name for p in patterns]
    assert names[0] == "dense" and patterns[0].density == 1.0
    if len(patterns) == 1:
        pytest.skip("cuflash.masks is not importable here")
    assert names[1:] == ["butterfly(64)", "fixed(64, 8, 1)", "strided(64, 8)", "local(64, 2)",
                         "causal(64)", "random(64, 0.1, 0)"]
    for p in patterns[1:]:
        assert p.error is None and 0 < p.density < 1
        assert p.mask.to_dense().shape == (64, 64)
    assert patterns[1].density == pytest.approx(7 / 64)  # 1 + log2(64) blocks a row
    assert patterns[4].density == pytest.approx((5 * 64 - 6) / 64**2)  # |i - j| <= 2


def test_patterns_degrade():
    partial = types.SimpleNamespace(butterfly=lambda n: (_ for _ in ()).throw(ValueError("no")))
    patterns = sparse.build_patterns(64, partial)
    assert patterns[0].name == "dense"
    assert patterns[1].error == "ValueError: no"
    assert all(p.error for p in patterns[1:])  # missing functions: AttributeError kept


def test_block_mask_support_detection(monkeypatch):
    assert not sparse.block_mask_supported(lambda q, k, v, *, causal=False: None)
    assert sparse.block_mask_supported(lambda q, k, v, *, block_mask=None: None)
    assert sparse.block_mask_supported(lambda q, k, v, **kw: None)
    assert sparse.is_missing_block_mask(TypeError("attention() got an unexpected keyword "
                                                  "argument 'block_mask'"))
    assert not sparse.is_missing_block_mask(TypeError("dtype"))
    import cuflash

    monkeypatch.setattr(cuflash, "attention", lambda q, k, v, *, causal=False, scale=None: None)
    assert sparse.cuflash_case("fwd", object()) == (None, sparse.NOT_IN_BUILD)
    case, reason = sparse.cuflash_case("fwd", None)  # dense needs no block_mask
    assert reason is None and callable(case[0])


def test_flex_block_mask_on_cpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.nn.attention.flex_attention")
    present = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 1]], bool)
    bm = sparse.flex_block_mask(torch, present, (128, 128), device="cpu")
    assert bm.to_dense()[0, 0].numpy().astype(bool).tolist() == present.tolist()


def _sparse_records():
    records = []
    for name, kind, density, mine, theirs in (
            ("dense", "dense", 1.0, 4.0, 5.0),
            ("butterfly(64)", "butterfly", 7 / 64, None, 1.0),
            ("local(64, 2)", "local", 0.077, None, None)):
        cu = ({"ms": mine, "status": "ok", "error": None} if mine else
              {"ms": None, "status": "unavailable", "error": sparse.NOT_IN_BUILD})
        fl = ({"ms": theirs, "status": "ok", "error": None} if theirs else
              {"ms": None, "status": "error", "error": "RuntimeError: flex broke"})
        records.append({"mode": "fwd", "pattern": name, "kind": kind, "density": density,
                        "seqlen": 8192, "hdim": 64, "batch": 2, "heads": 32,
                        "dtype": "bfloat16", "block_size": 128, "flops": 1e12 * density,
                        "masks_reason": None, "backends": {"cuflash": cu, "flex": fl}})
    return records


def test_sparse_table_layout():
    args = cli.parse_args(["--modes", "fwd"])
    text = sparse.format_sparse(_sparse_records(), args, common.Footnotes())
    assert "block-sparse forward, seq 8192, head dim 64, 2 x 32" in text
    for column in ("pattern", "density", "cuflash ms", "cuflash vs dense", "flex ms",
                   "flex vs dense", "cuflash / flex"):
        assert column in text
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    assert "4.000" in text and "1.25x" in text  # dense: flex 5 / cuflash 4
    assert "5.00x" in text  # flex butterfly: 5 ms dense / 1 ms
    assert f"[1] {sparse.NOT_IN_BUILD}" in text
    assert "flex: RuntimeError: flex broke" in text
    assert sparse.cuflash_failures(_sparse_records()) == []
    no_flex = cli.parse_args(["--modes", "fwd", "--peers", "standard"])
    assert "flex ms" not in sparse.format_sparse(_sparse_records(), no_flex, common.Footnotes())


def test_sparse_table_per_length():
    """--sparse-seqlen 16384 4096: a table per mode and length, shortest first, each with its
    own dense row for the speedups."""
    args = cli.parse_args(["--modes", "fwd", "bwd", "--sparse-seqlen", "16384", "4096"])
    assert args.sparse_seqlen == [16384, 4096]
    assert sparse.count_steps(args) == 2 * 2 * 7 * 2  # 2 modes x 2 lengths x 7 patterns x 2 backends
    records = []
    for mode in ("bwd", "fwd"):
        for seqlen, dense_ms in ((16384, 8.0), (4096, 2.0)):
            for record in _sparse_records():
                record = dict(record, mode=mode, seqlen=seqlen, backends=dict(record["backends"]))
                if record["kind"] == "dense":
                    record["backends"]["cuflash"] = {"ms": dense_ms, "status": "ok", "error": None}
                records.append(record)
    text = sparse.format_sparse(records, args, common.Footnotes())
    titles = [line for line in text.splitlines() if line.startswith("block-sparse")]
    assert [t.split(",")[0:2] for t in titles] == [
        ["block-sparse forward", " seq 4096"], ["block-sparse forward", " seq 16384"],
        ["block-sparse backward", " seq 4096"], ["block-sparse backward", " seq 16384"]]
    assert "2.000" in text and "8.000" in text
    assert "0.62x" in text and "2.50x" in text  # cuflash / flex, dense: 5 / 8 ms at 16k, 5 / 2 ms at 4096


# ---- raw numbers -------------------------------------------------------------------------


def _results():
    io_result = io.analytical_io()
    io_result["methods"]["cuflash"].update(ms=5.0, status="ok",
                                           ncu={"status": "ok", "read": 10, "write": 20})
    return {"info": {"gpu": "fake"}, "settings": cli.settings(cli.parse_args([])),
            "speed": {"records": _speed_records()}, "memory": {"records": _memory_records()},
            "io": {"result": io_result}, "sparse": {"records": _sparse_records()}}


def test_csv_and_json(tmp_path):
    results = _results()
    cli.write_csv(str(tmp_path / "r.csv"), results)
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(cli.CSV_FIELDS)
    tables = [r["table"] for r in rows]
    assert tables.count("speed") == 3 * 5 and tables.count("memory") == 4 * 4
    assert tables.count("io") == 2 + 1 + len(io.SWEEP_TILES)  # + the cuflash ncu row
    assert tables.count("sparse") == 3 * 2
    first = rows[0]
    assert first["backend"] == "cuflash" and float(first["ms"]) == 1.0
    assert float(first["tflops"]) == pytest.approx(137.4, abs=0.05)
    ncu = [r for r in rows if r["bytes_source"] == "ncu"]
    assert len(ncu) == 1 and ncu[0]["bytes_read"] == "10"
    oom = [r for r in rows if r["table"] == "memory" and r["status"] == "oom"]
    assert oom and oom[0]["peak_bytes"] == ""
    cli.write_json(str(tmp_path / "r.json"), results)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["settings"]["repeats"] == "auto"
    assert data["io"]["result"]["methods"]["standard"]["analytical"]["read"] == \
        io.standard_traffic(1024, 64, 16, 64).read
    assert len(data["speed"]["records"]) == 3


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no",
                           "--plot", str(tmp_path / "p.png")])
    records = _speed_records()
    more = json.loads(json.dumps(records))
    for r in more:
        r["seqlen"] = 2048
    cli.plot_speed(args.plot, records + more, args)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the command without a GPU -----------------------------------------------------------


def test_import_needs_neither_cupy_nor_torch():
    code = ("import sys, cuflash.bench.cli, cuflash.bench.io, cuflash.bench.sparse; "
            "print('cupy' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False False"


def assert_one_no_gpu_line(stderr: str, not_run: str):
    """stderr is the one line naming the tables not run, why (CuPy's own reason varies by
    machine: no driver, no device), and the command that runs anywhere."""
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"cuflash-bench: {not_run}: not run, they need a CUDA GPU (no "), stderr
    assert stderr.strip().endswith("). cuflash-bench --tables io runs without one."), stderr


@pytest.mark.parametrize("argv, not_run", [(["--tables", "speed"], "speed"), (["--tables", "io", "--io"], "io --io"),
                                           (["--tables", "host", "e2e"], "host, e2e"),
                                           (["--tables", "varlen"], "varlen")])
def test_no_gpu_exits_with_one_line(argv, not_run):
    out = run_cli(*argv)
    assert out.returncode == 2
    assert_one_no_gpu_line(out.stderr, not_run)
    assert out.stdout == ""


@pytest.mark.parametrize("argv, not_run", [([], "speed, memory, sparse, decode, varlen, host, e2e"),
                                           (["--tables", "io", "memory"], "memory")])
def test_no_gpu_prints_the_io_table_then_exits(argv, not_run):
    """The tables that need no GPU come first, then the one line and exit status 2 (tables
    asked for were not made)."""
    out = run_cli(*argv)
    assert out.returncode == 2
    assert_one_no_gpu_line(out.stderr, not_run)
    assert "IO: GPT-2 medium attention" in out.stdout and "runtime not measured" in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= common.CAPTION_WIDTH


def test_no_gpu_io_table_prints(tmp_path):
    out = run_cli("--tables", "io", "--json", str(tmp_path / "io.json"),
                  "--csv", str(tmp_path / "io.csv"))
    assert out.returncode == 0, out.stderr
    assert "IO: GPT-2 medium attention" in out.stdout and "bytes: analytical count" in flat(out.stdout)
    assert "not run" not in out.stderr  # every table asked for was made
    assert f"[1] {cli.NO_GPU_RUNTIME}" in out.stdout
    data = json.loads((tmp_path / "io.json").read_text())
    assert data["io"]["result"]["bytes_source"] == "analytical"
    assert data["info"]["reason"].startswith("no "), data["info"]
    assert (tmp_path / "io.csv").read_text().startswith("table,dtype,mode")


def test_entry_points():
    out = run_cli("--help", module="cuflash.bench")
    assert out.returncode == 0 and "--tables" in out.stdout and "--plot" in out.stdout
    bad = run_cli("--modes", "sideways")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'cuflash-bench = "cuflash.bench.cli:main"' in text and 'plot = ["matplotlib>=' in text


# ---- the whole command on fakes ----------------------------------------------------------


class _FakeGpu(NumpyAsCupy):
    """NumPy under CuPy's name with events, streams and a memory pool: enough for cli.run."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.random = types.SimpleNamespace(
            standard_normal=lambda shape, dtype=np.float32: rng.standard_normal(shape).astype(dtype))

        class Event:
            def record(self):
                pass

            def synchronize(self):
                pass

        stream = types.SimpleNamespace(synchronize=lambda: None)
        self.cuda = types.SimpleNamespace(
            Event=Event, get_current_stream=lambda: stream, get_elapsed_time=lambda a, b: 2.0,
            memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))

    def get_default_memory_pool(self):
        return types.SimpleNamespace(free_all_blocks=lambda: None)


def _fake_run(monkeypatch, tmp_path, argv, fail_cuflash=False):
    fake = _FakeGpu()
    env = common.Env(fake, None, "no torch in this test", "float32", np.float32, None,
                     np.dtype(np.float32), None, True, 10_000)
    import dataclasses

    monkeypatch.setattr(common, "setup_env", lambda dtype, prog=common.PROG:
                        dataclasses.replace(env, dtype_name=dtype))
    monkeypatch.setattr(common, "prebuild", lambda variants, jobs=None: len(variants))
    monkeypatch.setattr(common, "device_info", lambda env: {
        "gpu": "FakeGPU", "sms": 1, "l2_mb": 0.01, "memory_bytes": 2**30, "cuda_runtime": "0",
        "cuda_driver": "0", "cupy": "0", "torch": None, "torch_reason": env.torch_reason,
        "commit": "test", "inputs": "numpy"})
    monkeypatch.setattr(common, "measure_ceilings", lambda env, repeats=None: {
        "matmul": "fake", "matmul_n": 8, "matmul_ms": 1.0, "matmul_tflops": 100.0,
        "copy_bytes": 2**30, "copy_ms": 1.0, "copy_gbps": 2000.0})
    small = lambda seq, hdim, tokens=None, hidden=None: (1, 2, seq, hdim)  # noqa: E731
    monkeypatch.setattr(speed, "problem_shape", small)
    monkeypatch.setattr(common, "problem_shape", small)
    monkeypatch.setitem(io.GPT2_MEDIUM, "seq", 64)
    monkeypatch.setitem(io.GPT2_MEDIUM, "batch", 1)
    monkeypatch.setitem(io.GPT2_MEDIUM, "heads", 2)
    monkeypatch.setitem(io.GPT2_MEDIUM, "hdim", 16)

    def check(*_):
        if fail_cuflash:
            raise RuntimeError("cuflash kernel failed")

    def fwd(causal, hdim=None, tiles=None):
        def run(q, k, v):
            check()
            return ref.standard_attention(q, k, v, causal=causal).o
        return speed.Backend("cuflash", run, is_cuflash=True)

    def both(causal):
        def run(q, k, v, do):
            check()
            return ref.standard_attention_backward(do, q, k, v, causal=causal)
        return speed.Backend("cuflash", run, is_cuflash=True)

    def bwd(causal):
        def prepare(q, k, v, do):
            return (do, q, k, v)
        def run(do, q, k, v):
            check()
            return ref.standard_attention_backward(do, q, k, v, causal=causal)
        return speed.Backend("cuflash", run, prepare=prepare, is_cuflash=True)

    monkeypatch.setattr(speed, "cuflash_backend", fwd)
    monkeypatch.setattr(speed, "cuflash_backward_backend", bwd)
    monkeypatch.setattr(speed, "cuflash_fwdbwd_backend", both)
    monkeypatch.setattr(memory, "measure_cuflash", lambda env, args, inputs: {
        "status": "ok", "error": None, "peak_bytes": 4 * inputs[0].nbytes,
        "retained_bytes": 0, "allocations": 4})
    real_case_fn = io.case_fn

    def case_fn(env, method, mode, causal, shape):
        if method == "standard":
            return real_case_fn(env, method, mode, causal, shape)
        return (fwd(causal).fn if mode == "fwd" else both(causal).fn)

    monkeypatch.setattr(io, "case_fn", case_fn)
    monkeypatch.setattr(io, "tiles_context", lambda tiles, hdim: __import__("contextlib").nullcontext())
    def cuflash_case(mode, mask):  # this build has no block-sparse kernels
        if mask is not None:
            return None, sparse.NOT_IN_BUILD
        return ((fwd(False).fn if mode == "fwd" else both(False).fn), None), None

    monkeypatch.setattr(sparse, "cuflash_case", cuflash_case)

    def cupy_calls(env):  # host rows: calls that cost no GPU work, or fail as asked
        return {name: (check, lambda out: None) for name in ("cupy_fwd", "cupy_bwd")}

    monkeypatch.setattr(host, "cupy_calls", cupy_calls)
    monkeypatch.setattr(host, "load_jax", lambda: (None, "no JAX in this test"))
    args = cli.parse_args(argv + ["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")])
    return cli.run(args)


def test_run_every_table_on_fakes(monkeypatch, tmp_path, capsys):
    code = _fake_run(monkeypatch, tmp_path, [
        "--seqlens", "32", "64", "--hdims", "16", "--dtypes", "float32", "--repeats", "3",
        "--memory-seqlens", "32", "64", "--sparse-seqlen", "256",
        "--tables", "speed", "memory", "io", "sparse", "host", "e2e"])  # decode: test_bench_decode.py
    out = capsys.readouterr()
    assert code == 0, out.err
    text = out.out
    assert "GPU: FakeGPU" in text and "ceilings: matmul" in text
    for title in ("forward, causal=no, head dim 16, float32",
                  "forward + backward, causal=yes, head dim 16, float32",
                  "peak extra memory of forward + backward",
                  "IO: GPT-2 medium attention", "IO: bytes moved and runtime against the tile size",
                  "block-sparse forward, seq 256", "block-sparse forward + backward, seq 256",
                  "host: CPU microseconds per call", "e2e: PyTorch, forward + backward",
                  "e2e: JAX"):
        assert title in text
    assert "no JAX in this test" in text and "cuflash (CuPy) | forward" in text
    assert "PyTorch SDPA columns: no torch in this test" in text
    if sparse.load_masks()[0] is not None:
        assert sparse.NOT_IN_BUILD in text and "butterfly(2)" in text
    assert "FAILED" not in text
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) >= {"info", "settings", "ceilings", "speed", "memory", "io", "sparse",
                         "host", "e2e"}
    assert data["host"]["results"]["cupy_fwd"]["status"] == "ok"
    assert data["host"]["results"]["torch_fwd"]["status"] == "unavailable"
    assert len(data["e2e"]["records"]) == len(e2e.SHAPES)
    speed_rows = data["speed"]["records"]
    assert len(speed_rows) == 2 * 3 * 2  # seqlens x modes x causal
    assert all(r["backends"]["cuflash"]["ms"] == 2.0 for r in speed_rows)
    assert all(r["backends"]["standard"]["status"] == "ok" for r in speed_rows)
    assert data["io"]["result"]["methods"]["standard"]["ms"] == 2.0
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["table"] for r in rows} == {"speed", "memory", "io", "sparse", "host", "e2e"}
    assert "[" in out.err  # progress lines on stderr


def test_run_exits_1_when_cuflash_fails(monkeypatch, tmp_path, capsys):
    code = _fake_run(monkeypatch, tmp_path, [
        "--tables", "speed", "--seqlens", "32", "--hdims", "16", "--dtypes", "float32",
        "--modes", "fwd", "--causal", "no", "--repeats", "2", "--peers", "standard"],
        fail_cuflash=True)
    out = capsys.readouterr()
    assert code == 1
    assert "FAILED [1]" in out.out and "cuflash: RuntimeError: cuflash kernel failed" in out.out
    assert "cuflash-bench: cuflash failed in 1 measurement(s)" in out.err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["speed"]["records"][0]["backends"]["standard"]["status"] == "ok"


def test_kernel_variants():
    args = cli.parse_args([])
    keys = [v.key for v in cli.kernel_variants(args)]
    assert len(keys) == len(set(keys))
    # 4 dense (hdim x causal), the IO sweep's tiles (one of them the default, unless the dense
    # forward runs on wgmma), 1 block-sparse; on wgmma each forward in its persistent form (short
    # queries) and its one-item-a-CTA form (long ones)
    wgmma = common.device_has_wgmma()
    forms = 2 if wgmma else 1
    assert sum(k.startswith("fwd_") for k in keys) == 5 * forms + len(io.SWEEP_TILES) - (not wgmma)
    assert sum("_sparse" in k for k in keys) == forms + 1  # its forward(s) and backward key pass
    args = cli.parse_args(["--tables", "speed", "--hdims", "64", "--causal", "no", "--tiles",
                           "64,64,4,1"])
    assert [v.key.split("_")[0] for v in cli.kernel_variants(args)].count("fwd") == forms + 1


# ---- host and e2e tables -----------------------------------------------------------------


def test_host_us_is_wall_time_per_call():
    ticks = iter([10.0, 10.5])  # start, end: 0.5 s for 1000 calls
    calls, drained = [], []
    us = host.host_us(lambda: calls.append(1), drained.append, calls=1000, warmup=7,
                      clock=lambda: next(ticks))
    assert us == pytest.approx(500.0) and len(calls) == 1007 and len(drained) == 2


def _host_results(**us):
    out = {c.name: {"us": us.get(c.name), "status": "ok" if c.name in us else "unavailable",
                    "error": None if c.name in us else "JAX is not available (no jax)"}
           for c in host.CASES}
    return out


def test_host_table_targets_and_footnotes():
    results = _host_results(cupy_fwd=8.0, cupy_bwd=40.0, torch_fwd=60.0, sdpa_fwd=22.0,
                            torch_fwdbwd=200.0, sdpa_fwdbwd=170.0)
    results["sdpa_fwdbwd"] = {"us": None, "status": "error", "error": "RuntimeError: nope"}
    results["torch_fwdbwd"] = {"us": None, "status": "error", "error": "CUDADriverError: boom"}
    text = host.format_host(results, common.Footnotes())
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
            [c.strip() for c in line.strip("|").split("|")[2:]]
            for line in text.splitlines() if line.startswith("| ") and "API" not in line}
    assert rows[("cuflash (CuPy)", "forward")] == ["8.0", "\u2013", "<= 10 us", "met"]
    assert rows[("cuflash (CuPy)", "backward")] == ["40.0", "\u2013", "<= 15 us", "missed"]
    assert rows[("cuflash.torch", "forward")] == ["60.0", "+38.0 (SDPA)", "<= SDPA + 25 us", "missed"]
    fwdbwd = rows[("cuflash.torch", "fwd + bwd (autograd)")]
    assert fwdbwd[0].startswith("FAILED [") and fwdbwd[1:] == ["\u2013", "<= SDPA + 65 us", "\u2013"]
    assert rows[("SDPA", "fwd + bwd (autograd)")][0].startswith("\u2013 [")
    assert rows[("cuflash.jax", "jit(grad)")][0].startswith("\u2013 [")
    assert rows[("cuflash.jax", "jit(grad)")][2] == "<= JAX cuDNN + 20 us"
    text = flat(text)
    assert "cuflash.torch fwd + bwd (autograd): CUDADriverError: boom" in text
    assert "JAX is not available (no jax)" in text and text.count("JAX is not available") == 1
    assert "the median over 10 rounds" in text and "200 back-to-back calls" in text
    assert host.cuflash_failures(results) == [
        ("host: cuflash.torch fwd + bwd (autograd)", "CUDADriverError: boom")]


def test_host_targets_are_issue_14s():
    assert {n: (t.limit_us, t.over_peer) for n, t in host.TARGETS.items()} == {
        "cupy_fwd": (10, False), "cupy_bwd": (15, False), "torch_fwd": (25, True),
        "torch_fwdbwd": (65, True), "jax_fwd": (20, True), "jax_grad": (20, True)}
    assert host.TARGETS["torch_fwd"].met(47.0, 22.0) and not host.TARGETS["torch_fwd"].met(47.1, 22.0)
    assert host.TARGETS["torch_fwd"].met(30.0, None) is None


class _FakeStopwatch:
    def __init__(self, ms_per_loop):
        self.ms = iter(ms_per_loop)
        self.log = []

    def drain(self, out):
        self.log.append("drain")

    def start(self):
        self.log.append("start")

    def stop(self, out):
        self.log.append("stop")
        return next(self.ms)


def test_time_loops_sizes_loops_and_takes_medians(monkeypatch):
    monkeypatch.setattr(e2e, "ROUND_TARGET_MS", 30.0)
    seen = []
    # the one-call estimate: 2 ms -> 15 calls a loop; then 5 loops of 15 calls
    watch = _FakeStopwatch([2.0, 30.0, 45.0, 15.0, 30.0, 60.0])
    clock = iter(range(100))  # every reading 1 s later: 1 s issuing a loop
    got = e2e.time_loops(lambda *s: seen.append(s), [("a",), ("b",), ("c",)], watch,
                         rounds=5, warmup=2, clock=lambda: float(next(clock)))
    assert got["calls"] == 15 and got["ms"] == pytest.approx(2.0)  # median of 2, 3, 1, 2, 4
    assert got["host_us"] == pytest.approx(1e6 / 15)
    assert len(seen) == 2 + 1 + 5 * 15
    assert [s[0] for s in seen[:6]] == ["a", "b", "c", "a", "b", "c"]  # rotating sets
    assert watch.log[:3] == ["drain", "start", "stop"]


def _e2e_records():
    def ok(ms, us):
        return {"ms": ms, "host_us": us, "calls": 10, "status": "ok", "error": None}
    records = []
    for shape in e2e.SHAPES:
        backends = {"cuflash.torch": ok(2.0, 900.0), "sdpa": ok(0.5, 100.0),
                    "sdpa_flash": ok(1.0, 90.0),
                    "sdpa_cudnn": {"ms": None, "host_us": None, "calls": 0, "status": "error",
                                   "error": "RuntimeError: No available kernel"}}
        backends.update({n: {"ms": None, "host_us": None, "calls": 0, "status": "unavailable",
                             "error": "JAX is not available (no jax)"} for n in e2e.JAX_BACKENDS})
        records.append({"shape": {}, "label": shape.label, "backends": backends})
    return records


def test_e2e_tables_layout_and_footnotes():
    text = e2e.format_e2e(_e2e_records(), common.Footnotes())
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    assert "8x12x1024x64 (GPT-2 small)" in text and "2x32x8192x128 kv 8 (GQA)" in text
    header = next(line for line in text.splitlines() if "shape" in line and "sdpa ms" in line)
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "shape (B x H x N x d)", "cuflash ms", "host us", "sdpa ms", "vs sdpa", "flash ms",
        "vs flash", "cudnn ms", "vs cudnn"]
    row = next(line for line in text.splitlines() if line.startswith("| 4x32x2048x128 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:7] == ["2.000", "900", "0.500", "0.25x", "1.000", "0.50x"]
    assert cells[7].startswith("\u2013 [") and cells[8] == "\u2013"
    assert "sdpa_cudnn: RuntimeError: No available kernel" in text
    assert text.count("JAX is not available (no jax)") == 1  # one footnote for every JAX cell
    assert e2e.cuflash_failures(_e2e_records()) == []
    wide = e2e.format_e2e(_e2e_records(), common.Footnotes(), wide=True)
    header = next(line for line in wide.splitlines() if "shape" in line and "sdpa ms" in line)
    assert "| sdpa host us |" in header and "| flash host us |" in header
    row = next(line for line in wide.splitlines() if line.startswith("| 4x32x2048x128 "))
    assert [c.strip() for c in row.strip("|").split("|")][5] == "100"
    assert "--wide adds" not in wide


def test_e2e_shapes_are_issue_14s():
    dims = [(s.batch, s.heads, s.kv_heads, s.seq, s.hdim) for s in e2e.SHAPES]
    assert dims[:4] == [(8, 12, 12, 1024, 64), (32, 12, 12, 256, 64), (4, 32, 32, 2048, 128),
                        (1, 32, 32, 8192, 128)]
    gqa = dims[4:]
    assert [s[3] for s in gqa] == [2048, 4096, 8192]
    assert all(s[1:3] == (32, 8) and s[4] == 128 and s[0] * s[3] == 16384 for s in gqa)
    l2 = types.SimpleNamespace(l2_bytes=60 * 10**6)
    assert e2e.input_set_count(l2, e2e.SHAPES[0]) == 3  # 4 x 12.6 MB a set, > 120 MB in all
    assert e2e.input_set_count(l2, e2e.SHAPES[3]) == 2  # 4 x 67 MB a set


def test_host_and_e2e_kernels_are_prebuilt():
    args = cli.parse_args(["--tables", "host", "e2e"])
    keys = {v.key for v in cli.kernel_variants(args)}
    assert e2e.variant_shapes() == {("bfloat16", 64, True), ("bfloat16", 128, True)}
    for d in (64, 128):  # the causal bf16 forwards of both head dims, and nothing else forward
        forms = cli.forward_forms("bfloat16", d, True, wgmma=common.device_has_wgmma())
        assert {v.key for v in forms} <= keys
    assert len([k for k in keys if k.startswith("fwd_")]) == 2 * len(forms)


# ---- the commit printed and the JSON written ---------------------------------------------


def _git(cwd, *argv):
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True,
                          env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
                                   GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_the_projects_own_or_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("CUFLASH_COMMIT", raising=False)
    outer = tmp_path / "outer"
    (outer / "tree" / "cuflash").mkdir(parents=True)
    _git(outer, "init", "-q")
    (outer / "README").write_text("the enclosing repository\n")
    _git(outer, "add", "README")
    _git(outer, "commit", "-q", "-m", "outer")
    # a copy of the tree inside another repository: not that repository's commit
    assert common.git_commit(outer / "tree") == "unknown"
    # the project's own repository: its commit
    own = outer / "tree"
    _git(own, "init", "-q")
    (own / "cuflash" / "__init__.py").write_text("")
    _git(own, "add", "cuflash")
    _git(own, "commit", "-q", "-m", "own")
    assert common.git_commit(own) == _git(own, "rev-parse", "--short", "HEAD")
    assert common.git_commit(own) != _git(outer, "rev-parse", "--short", "HEAD")
    (own / "cuflash" / "__init__.py").write_text("# edited after the commit\n")  # files newer than HEAD
    assert common.git_commit(own) == _git(own, "rev-parse", "--short", "HEAD") + "+changes"
    (own / "cuflash" / "__init__.py").write_text("")
    plain = tmp_path / "plain"  # no repository at all
    plain.mkdir()
    assert common.git_commit(plain) == "unknown"
    monkeypatch.setenv("CUFLASH_COMMIT", "abc1234")
    assert common.git_commit(outer / "tree") == "abc1234"


def test_json_is_compact(tmp_path):
    records = [{"seqlen": n, "backends": {"cuflash": {"ms": 1.0, "times_ms": [1.0, 2.0, 0.5]}}}
               for n in range(40)]
    results = {"info": {"gpu": "x"}, "speed": {"records": records, "footnotes": []}}
    cli.write_json(str(tmp_path / "r.json"), results)
    text = (tmp_path / "r.json").read_text()
    assert len(text.splitlines()) <= len(records) + 10  # a record a line
    data = json.loads(text)
    entry = data["speed"]["records"][3]["backends"]["cuflash"]
    assert entry == {"ms": 1.0, "calls": 3, "min_ms": 0.5, "max_ms": 2.0}
    assert results["speed"]["records"][3]["backends"]["cuflash"]["times_ms"] == [1.0, 2.0, 0.5]


@requires_gpu
def test_host_and_e2e_run_on_the_gpu():
    """The host and e2e measurements end to end at small sizes: every cuflash row measured
    (JAX rows may be unavailable), the tables within 120 columns."""
    env = common.setup_env("bfloat16")
    with env.stream():
        measured = host.run_host(env, calls=50)
        records = e2e.run_e2e(env, shapes=(e2e.Shape(2, 4, 2, 256, 64, "tiny GQA"),))
    assert host.cuflash_failures(measured) == [] and e2e.cuflash_failures(records) == []
    frameworks = ["cupy"] + (["torch"] if env.torch is not None else [])
    for case in host.CASES:
        entry = measured[case.name]
        if case.framework in frameworks:
            assert entry["status"] == "ok" and 0 < entry["us"] < 1e5, (case.name, entry)
        else:
            assert entry["status"] in ("ok", "unavailable"), (case.name, entry)
    mine = records[0]["backends"]["cuflash.torch"]
    if env.torch is not None:
        assert mine["status"] == "ok" and mine["ms"] > 0 and mine["host_us"] > 0
        assert mine["calls"] >= e2e.MIN_CALLS
    assert records[0]["backends"]["cuflash.jax"]["status"] in ("ok", "unavailable")
    for text in (host.format_host(measured, common.Footnotes()),
                 e2e.format_e2e(records, common.Footnotes())):
        assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH


def test_host_rows_take_turns_and_report_their_median_round():
    """_interleaved: every case warmed up, then rounds alternating their order; a case's figure
    is its median round; a case that raises is an error entry and leaves the rounds."""
    log = []
    cases = [host.CASE_BY_NAME[n] for n in ("torch_fwd", "sdpa_fwd", "torch_fwdbwd")]
    now = [0.0]

    def clock():
        return now[0]

    def call(name, cost):
        def fn():
            log.append(name)
            now[0] += cost.pop(0) if isinstance(cost, list) else cost
        return fn

    failing_calls = []

    def failing():  # its warm-up passes, its first timed call raises
        failing_calls.append(1)
        if len(failing_calls) > 2:
            raise RuntimeError("boom")
        log.append("torch_fwdbwd")

    # torch_fwd: rounds of 1, 9, 2 us a call (median 2); sdpa_fwd 1 us; torch_fwdbwd fails in round 1.
    costs = [0.0] * 2 + [1e-6] * 4 + [9e-6] * 4 + [2e-6] * 4
    fns = {"torch_fwd": (call("torch_fwd", costs), lambda _: None),
           "sdpa_fwd": (call("sdpa_fwd", 1e-6), lambda _: None),
           "torch_fwdbwd": (failing, lambda _: None)}
    got = host._interleaved(cases, fns, calls=12, rounds=3, warmup=2, clock=clock)
    assert got["torch_fwd"]["us"] == pytest.approx(2.0) and got["sdpa_fwd"]["us"] == pytest.approx(1.0)
    assert got["torch_fwdbwd"]["status"] == "error" and "boom" in got["torch_fwdbwd"]["error"]
    rounds = log[6:]  # after the warm-up (2 calls each)
    assert rounds[:8] == ["torch_fwd"] * 4 + ["sdpa_fwd"] * 4  # round 1 in order, then torch_fwdbwd fails
    assert rounds[8:12] == ["sdpa_fwd"] * 4  # round 2 reversed
