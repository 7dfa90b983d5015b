"""CPU tests of the speed and memory tables of cuflash-bench (cuflash.bench.speed and
cuflash.bench.memory): FLOP counts, shapes, speed options, report layout (compact and
--wide), the standard backward's algebra (NumPy standing in for CuPy), and the memory
table's bookkeeping.

Nothing here needs a GPU; importing the benchmark modules must not import CuPy.
"""

import types

import numpy as np
import pytest

from cpu_fakes import NumpyAsCupy
from cuflash import reference as ref
from cuflash.bench import cli, common, io, speed
from cuflash.bench import memory as bm


def test_flops_forward():
    # seq 1024, hdim 64: batch 16, heads 32
    assert io.flops(1024, 64, 32, 16, causal=False) == 4 * 1024**2 * 64 * 32 * 16
    assert io.flops(1024, 64, 32, 16, causal=True) == 2 * 1024**2 * 64 * 32 * 16
    assert io.flops(3, 8, 1, 1, causal=False) == 4 * 9 * 8


def test_flops_backward_is_two_and_a_half_forward():
    fwd = io.flops(1024, 64, 32, 16, causal=False)
    assert io.flops(1024, 64, 32, 16, causal=False, mode="fwd") == fwd
    assert io.flops(1024, 64, 32, 16, causal=False, mode="bwd") == 2.5 * fwd
    assert io.flops(1024, 64, 32, 16, causal=True, mode="bwd") == 2.5 * fwd / 2
    assert io.flops(3, 8, 1, 1, causal=False, mode="bwd") == 2.5 * 4 * 9 * 8
    with pytest.raises(ValueError):
        io.flops(3, 8, 1, 1, causal=False, mode="both")


def test_flops_grow_linearly_with_seqlen_in_the_harness():
    # 16k tokens per batch: doubling seq halves batch, so the FLOPs double.
    for hdim in (64, 128):
        counts = [io.flops(s, hdim, *common.problem_shape(s, hdim)[1::-1], causal=False)
                  for s in (1024, 2048, 4096)]
        assert counts[1] == 2 * counts[0] and counts[2] == 2 * counts[1]


def test_problem_shape():
    assert common.problem_shape(1024, 64) == (16, 32, 1024, 64)
    assert common.problem_shape(16384, 128) == (1, 16, 16384, 128)
    assert common.problem_shape(32768, 64) == (1, 32, 32768, 64)  # never batch 0


def test_backend_names_per_mode():
    args = cli.parse_args(["--tiles", "128,64,8,1", "--peers", "sdpa_flash"])
    assert speed.backend_names(args, "fwd") == ["cuflash", "cuflash[128,64,8,1]", "sdpa_flash"]
    assert speed.backend_names(args, "bwd") == ["cuflash", "sdpa_flash"]  # forward tiles only


def test_options():
    args = cli.parse_args([
        "--seqlens", "512", "2048", "--hdims", "128", "--causal", "yes", "--dtypes", "float16",
        "--repeats", "5", "--json", "out.json", "--tiles", "128,64,8,1", "--tiles", "64, 32, 4, 2, 4",
        "--peers", "sdpa_flash",
    ])
    assert args.seqlens == [512, 2048] and args.hdims == [128]
    assert args.causal_modes == [True]
    assert args.dtypes == ["float16"] and args.repeats == 5 and args.json == "out.json"
    assert args.tiles == [(128, 64, 8, 1), (64, 32, 4, 2, 4)]
    assert args.peers == ["sdpa_flash"]
    assert cli.parse_args(["--causal", "no"]).causal_modes == [False]


@pytest.mark.parametrize("argv", [
    ["--tiles", "128,60,8,1"],  # block_cols not a multiple of 16
    ["--tiles", "96,64,4,1"],  # block_rows not a multiple of 16 * warps
    ["--tiles", "128,64,8"],
    ["--tiles", "a,b,c,d"],
    ["--tiles", "128,64,8,0"],
    ["--causal", "maybe"],
    ["--repeats", "0"],
    ["--warmup", "0"],
    ["--seqlens", "0"],
    ["--peers", "xformers"],
    ["--modes"],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2


def test_tile_label():
    assert speed.tile_label((128, 64, 1)) == "cuflash[128,64,1]"


def test_input_sets_exceed_twice_l2():
    l2 = 60 * 10**6
    for set_bytes in (1, 10**6, 10 * 10**6, 59 * 10**6, 120 * 10**6, 3 * 64 * 2**20):
        n = common.num_input_sets(set_bytes, l2)
        assert n >= 2 and n * set_bytes > 2 * l2
        assert n == 2 or (n - 1) * set_bytes <= 2 * l2  # not more than needed


def test_footnotes_dedupe():
    notes = common.Footnotes()
    assert notes.mark("a") == "[1]"
    assert notes.mark("b") == "[2]"
    assert notes.mark("a") == "[1]"
    assert notes.lines() == ["[1] a", "[2] b"]


def _entry(ms, flop, status="ok", error=None):
    return {"status": status, "error": error, "ms": ms, "times_ms": [ms] if ms else [],
            "tflops": flop / (ms * 1e-3) / 1e12 if ms else None, "dtype": "bfloat16"}


def _layout_record():
    flop = io.flops(1024, 64, 32, 16, False)
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
    return record, env


def test_report_layout_wide():
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no",
                           "--tiles", "128,64,8,1", "--wide"])
    record, env = _layout_record()
    notes = common.Footnotes()
    text = speed.format_tables([record], args, {"matmul_tflops": 275.0}, env, notes)
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


def test_report_layout_fits_120_columns():
    """The default table: cuflash's own columns, then its ratio to each peer; a failed peer
    keeps its OOM / footnoted dash in its ratio column; captions wrap."""
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no"])
    record, env = _layout_record()
    text = speed.format_tables([record], args, {"matmul_tflops": 275.0}, env, common.Footnotes())
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
    header = next(line for line in text.splitlines() if "seqlen" in line)
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "seqlen", "batch x heads", "cuflash ms", "TFLOP/s", "% of peak", "vs standard",
        "vs flash", "vs cudnn", "vs efficient"]
    row = next(line for line in text.splitlines() if line.startswith("|") and "1024" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["1.000", "137.4", "50.0%"]
    assert cells[5] == "OOM" and cells[6] == "2.00x" and cells[8] == "\u2013"
    assert cells[7].startswith("\u2013 [") and "sdpa_cudnn: RuntimeError: No available kernel" in text
    assert "--wide adds" in text
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "no",
                           "--tiles", "128,64,8,1"])  # a tuning column keeps its time
    text = speed.format_tables([record], args, {"matmul_tflops": 275.0}, env, common.Footnotes())
    assert "| cuflash[128,64,8,1] ms |" in text and "| vs flash |" in text


def test_report_layout_backward():
    args = cli.parse_args(["--seqlens", "1024", "--hdims", "64", "--causal", "yes",
                           "--tiles", "128,64,8,1", "--wide"])
    records = []
    for mode, ms in (("fwd", 1.0), ("bwd", 2.0)):
        flop = io.flops(1024, 64, 32, 16, True, mode)
        backends = {"cuflash": _entry(ms, flop), "standard": _entry(3 * ms, flop),
                    "sdpa_flash": _entry(2 * ms, flop), "sdpa_cudnn": _entry(ms / 2, flop)}
        if mode == "fwd":
            backends["cuflash[128,64,8,1]"] = _entry(1.25, flop)
        records.append({"mode": mode, "seqlen": 1024, "hdim": 64, "causal": True, "batch": 16,
                        "heads": 32, "flops": flop, "backends": backends})
    env = types.SimpleNamespace(standard_reason=None, torch=None)
    text = speed.format_tables(records, args, {"matmul_tflops": 275.0}, env, common.Footnotes())
    fwd, bwd = text.split("backward, causal=yes, head dim 64, bfloat16")
    assert "forward, causal=yes, head dim 64, bfloat16" in fwd
    assert "cuflash[128,64,8,1] ms" in fwd and "cuflash[128,64,8,1]" not in bwd.split("\n\n")[1]
    # backward: 2.5 * 2 * 1024^2 * 64 * 32 * 16 FLOPs in 2 ms = 171.8 TFLOP/s
    assert "171.8" in bwd and "2.00x" in bwd and "0.50x" in bwd
    text = " ".join(text.split())  # the captions' line wraps undone
    assert "backward 2.5 x that" in text and "torch.autograd.grad" in text
    assert "rowsum(dO * O)" in text


def _standard_env(dtype=np.float32):
    return types.SimpleNamespace(cupy=np, standard_dtype=np.dtype(dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_standard_backward_matches_reference(causal):
    """The standard peer's explicit backward, run with NumPy as the array module."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 3, 40, 16)).astype(np.float32) for _ in range(4))
    forward, backward = speed.standard_parts(_standard_env(), causal, 40, 40, 16)
    o, p = forward(q, k, v)
    np.testing.assert_allclose(o, ref.standard_attention(q, k, v, causal=causal).o,
                               rtol=1e-4, atol=1e-5)
    grads = backward(q, k, v, do, o, p)
    exact = ref.standard_attention_backward(do, q, k, v, causal=causal)
    for got, want in zip(grads, exact):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_standard_backward_backend_prepares_one_set():
    backend = speed.standard_backward_backend(_standard_env(), False, 8, 8, 8)
    assert backend.max_sets == 1 and backend.prepare is not None
    x = np.ones((1, 1, 8, 8), np.float32)
    args = backend.prepare(x, x, x, x)
    assert len(args) == 6
    dq, dk, dv = backend.fn(*args)
    assert dq.shape == dk.shape == dv.shape == x.shape


def test_run_config_backward_plumbing(monkeypatch):
    """bwd mode end to end on a CPU: input sets with dO, prepare, the gradient check, FLOPs.

    cuflash's backward is stood in for by the float64 reference; the standard peer runs its
    real code with NumPy as the array module; SDPA is unavailable without torch."""
    env = types.SimpleNamespace(cupy=NumpyAsCupy(), torch=None, torch_reason="no torch here",
                                dtype_name="float32", standard_dtype=np.dtype(np.float32),
                                free_memory=lambda: None)
    calls = []

    def fake_time_call(cupy, fn, input_sets, warmup, repeats):
        calls.append(len(input_sets))
        return [1.0] * repeats, fn(*input_sets[0])

    def reference_backward(causal):
        def prepare(q, k, v, do):
            return (do, q, k, v)
        def run(do, q, k, v):
            return ref.standard_attention_backward(do, q, k, v, causal=causal)
        return speed.Backend("cuflash", run, prepare=prepare, is_cuflash=True)

    monkeypatch.setattr(speed, "time_call", fake_time_call)  # where run_config looks them up
    monkeypatch.setattr(speed, "cuflash_backward_backend", reference_backward)
    args = cli.parse_args(["--modes", "bwd", "--repeats", "2", "--tiles", "128,64,8,1"])
    rng = np.random.default_rng(1)
    sets = [tuple(rng.standard_normal((1, 2, 32, 16)).astype(np.float32) for _ in range(4))
            for _ in range(3)]
    record = speed.run_config(env, args, 16, 32, True, sets, "[test]", "bwd")
    assert record["mode"] == "bwd"
    assert record["flops"] == io.flops(32, 16, 128, 512, True, "bwd")
    assert list(record["backends"]) == ["cuflash", "standard", "sdpa_flash", "sdpa_cudnn",
                                        "sdpa_efficient"]
    assert record["backends"]["standard"]["ms"] == 1.0
    assert record["backends"]["sdpa_flash"]["status"] == "unavailable"
    assert calls == [3, 1]  # the standard peer keeps one P: one input set
    assert record["max_rel_grad_diff_vs_cuflash"]["standard"] < 1e-4


# ---- bench/memory.py ---------------------------------------------------------------------


def test_live_bytes_tracks_peak():
    live = bm.LiveBytes()
    live.free(99)  # allocated before tracking: ignored
    live.malloc(1, 512)
    live.malloc(2, 1024)
    live.free(1)
    live.malloc(3, 256)
    assert live.current == 1280 and live.peak == 1536 and live.allocations == 3
    live.free(2)
    live.free(3)
    live.malloc(1, 512)  # a pointer reused after its free
    assert live.current == 512 and live.peak == 1536


def test_growth_classification():
    assert bm.growth_kind(bm.growth_exponent(4096, 100, 16384, 400)) == "linear"
    assert bm.growth_kind(bm.growth_exponent(4096, 100, 16384, 1600)) == "quadratic"
    assert bm.growth_kind(bm.growth_exponent(4096, 100, 16384, 800)) == "super-linear"
    assert bm.growth_exponent(4096, 100, 16384, 400) == pytest.approx(1.0)
    assert bm.growth_exponent(4096, 0, 16384, 400) is None
    assert bm.growth_kind(None) == "unknown"


def _memory_records():
    def ok(nbytes):
        return {"status": "ok", "error": None, "peak_bytes": nbytes, "retained_bytes": nbytes}
    records = []
    for seq in (4096, 16384, 65536):
        outputs = 4 * bm.tensor_bytes(seq, 128, 16, 1)
        standard = ok(16 * 2**20 * (seq // 4096) ** 2) if seq < 65536 else {
            "status": "oom", "error": "not run: needs 384 GiB", "peak_bytes": None}
        records.append({"seqlen": seq, "outputs_bytes": outputs, "inputs_bytes": outputs,
                        "backends": {"cuflash": ok(outputs + 2**20 * seq // 4096),
                                     "sdpa_flash": ok(2 * outputs),
                                     "sdpa_cudnn": {"status": "error", "peak_bytes": None,
                                                    "error": "RuntimeError: no kernel"},
                                     "standard": standard}})
    return records


def test_memory_growth_and_table():
    records = _memory_records()
    steps = bm.growth(records, "cuflash")
    assert [s["kind"] for s in steps] == ["linear", "linear"]
    assert steps[0]["seq_ratio"] == 4 and steps[0]["memory_ratio"] == pytest.approx(4)
    assert [s["kind"] for s in bm.growth(records, "standard")] == ["quadratic"]
    assert bm.growth(records, "sdpa_cudnn") == []
    args = bm.memory_args([4096, 16384, 65536], 128, heads=16,
                          peers=("cuflash_torch", "sdpa_flash", "sdpa_cudnn", "standard"))
    text = bm.format_table(records, args, common.Footnotes())
    # seq 4096: o, dq, dk, dv = 4 x 16 MiB; cuflash 64 + 1 MiB; 0.51x of sdpa_flash's 128 MiB
    assert "o+dq+dk+dv MiB" in text and "cuflash MiB" in text and "cudnn MiB" in text and "standard MiB" in text
    assert "64.0" in text and "65.0" in text and "128.0" in text and "0.51x" in text
    assert "OOM [" in text and "not run: needs 384 GiB" in text
    assert "sdpa_cudnn: RuntimeError: no kernel" in text
    assert "growth, cuflash: 4096->16384 (4x seq): x4.00 (linear)" in text
    assert "growth, standard: 4096->16384 (4x seq): x16.00 (quadratic)" in text
    assert "Counted:" in text and "dq, dk, dv" in text and "MemoryHook" in text