"""CPU tests of the varlen table (cuflash.bench.varlen): the batches, FLOP counting of the
unpadded work, padding fractions, the layouts (packed, padded, nested, dense) checked against
the float64 reference, the table's rows, ratios, targets and footnotes from fake timings, and
its JSON and CSV. The one GPU test at the end runs the table at a small size."""

import contextlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import reference as ref
from cuflash.bench import cli, common, host, io, speed, varlen

torch = pytest.importorskip("torch")

REPO_ROOT = Path(__file__).resolve().parent.parent
AWKWARD = (1, 17, 113, 5)  # lengths of the small batches
SMALL_HEADS = (varlen.Heads(4, 2, 16, "tiny GQA"), varlen.Heads(3, 3, 8, "tiny MHA"))


# ---- batches and counts ----------------------------------------------------------------------


def test_mixed_batch_is_a_fixed_draw_within_the_range():
    batch = varlen.mixed_batch()
    assert batch == varlen.mixed_batch() and batch.kind == "mixed"
    assert batch.sequences == varlen.MIXED_SEQUENCES == 64
    assert all(varlen.MIXED_SHORTEST <= n <= varlen.MIXED_LONGEST for n in batch.lengths)
    assert len(set(batch.lengths)) > 32  # mixed indeed
    assert varlen.mixed_batch(seed=varlen.LENGTH_SEED + 1) != batch
    assert batch.label == "64 mixed" and varlen.equal_batch(16, 4096).label == "16 x 4096"
    assert varlen.mixed_batch(3, 7, 7).lengths == (7, 7, 7)
    with pytest.raises(ValueError, match=r"shortest <= longest, got 2 sequences of 9\.\.8"):
        varlen.mixed_batch(2, 9, 8)
    with pytest.raises(ValueError, match=r"lengths \(4, 0\)"):
        varlen.Batch("mixed", (4, 0))


def test_cu_seqlens_and_padded_rows_by_hand():
    cu = varlen.cu_seqlens((3, 1, 2))
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 4, 6]
    # longest 3: sequence 0 at rows 0-2, sequence 1 at row 3, sequence 2 at rows 6-7
    assert varlen.padded_rows((3, 1, 2)).tolist() == [0, 1, 2, 3, 6, 7]


def test_flops_count_the_unpadded_work():
    heads = varlen.Heads(2, 1, 8, "")
    batch = varlen.Batch("mixed", (3, 5))
    # causal forward: 4 L^2 d Hq / 2 per sequence
    assert varlen.useful_flops(batch, heads, "fwd") == 2 * 9 * 8 * 2 + 2 * 25 * 8 * 2 == 1088
    assert varlen.padded_flops(batch, heads, "fwd") == 2 * 2 * 25 * 8 * 2 == 1600
    assert varlen.useful_flops(batch, heads, "fwdbwd") == 3.5 * 1088
    assert varlen.padded_flops(batch, heads, "fwdbwd") == 3.5 * 1600
    assert varlen.pad_flop_fraction(batch, heads) == pytest.approx(1 - 1088 / 1600)
    assert batch.pad_token_fraction == pytest.approx(1 - 8 / 10)
    assert varlen.useful_flops(batch, heads, "fwd") == sum(
        io.flops(n, 8, 2, 1, True) for n in (3, 5))
    equal = varlen.equal_batch(4, 64)
    assert equal.pad_token_fraction == 0 and varlen.pad_flop_fraction(equal, heads) == 0
    assert varlen.useful_flops(equal, heads, "fwd") == io.flops(64, 8, 2, 4, True)


def test_the_default_batch_wastes_most_of_its_padded_flops():
    batch = varlen.mixed_batch()
    fractions = {varlen.pad_flop_fraction(batch, h) for h in varlen.HEADS}
    assert len(fractions) == 1  # the shares do not depend on the heads
    lengths = np.array(batch.lengths, dtype=np.float64)
    assert fractions.pop() == pytest.approx(1 - (lengths**2).sum() / (64 * lengths.max()**2))
    assert 0.3 < batch.pad_token_fraction < 0.7


def test_targets():
    batch, heads = varlen.mixed_batch(), varlen.HEADS[0]
    mixed = varlen._record(batch, heads, "fwd")
    saved = mixed["padded_flops"] / mixed["useful_flops"]
    assert saved == pytest.approx(1 / (1 - varlen.pad_flop_fraction(batch, heads)))
    assert varlen.target(mixed, "sdpa_flash_padded") == saved
    assert varlen.target(mixed, "sdpa_cudnn_padded") == saved
    for name in ("cuflash_packed", "cuflash_padded", "sdpa_flash_nested"):
        assert varlen.target(mixed, name) is None
    equal = varlen._record(varlen.equal_batch(16, 4096), heads, "fwd")
    assert varlen.target(equal, "cuflash_dense") == 0.95 and varlen.target(equal, "cuflash_packed") is None


def test_step_counts_and_kernels():
    assert varlen.count_steps() == 2 * 2 * (6 + 2 * 2)  # heads x modes x (mixed + 2 equal batches)
    assert varlen.count_steps(SMALL_HEADS, ((2, 8),)) == 2 * 2 * (6 + 2)
    assert varlen.variant_shapes() == {("bfloat16", 128, True), ("bfloat16", 64, True)}
    args = cli.parse_args(["--tables", "varlen"])
    forms = {v.key for d in (64, 128) for v in cli.forward_forms(
        "bfloat16", d, True, wgmma=common.device_has_wgmma())}
    assert forms <= {v.key for v in cli.kernel_variants(args)}


# ---- layouts, against the float64 reference ----------------------------------------------------


def packed_reference(q, k, v, lengths, causal=True, do=None):
    """Per-sequence float64 reference on packed (total, H, d) tensors: o, or (dq, dk, dv) when
    do is given, packed the same way."""
    cu = varlen.cu_seqlens(lengths)
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        q_s, k_s, v_s = (x[a:b].transpose(0, 1).numpy() for x in (q, k, v))
        if do is None:
            parts.append((ref.standard_attention(q_s, k_s, v_s, causal=causal).o,))
        else:
            parts.append(ref.standard_attention_backward(
                do[a:b].transpose(0, 1).numpy(), q_s, k_s, v_s, causal=causal))
    joined = [np.concatenate([p[i].swapaxes(0, 1) for p in parts]) for i in range(len(parts[0]))]
    return joined[0] if do is None else joined


def packed_inputs(lengths, heads, seed=None):
    gen = torch.Generator().manual_seed(int(np.random.default_rng(seed).integers(1 << 31)))
    total = sum(lengths)
    return tuple(torch.randn((total, h, heads.hdim), generator=gen, dtype=torch.float64)
                 for h in (heads.q, heads.kv, heads.kv, heads.q))


def test_pad_view_and_unpack_are_inverse():
    lengths = AWKWARD
    x = packed_inputs(lengths, SMALL_HEADS[0])[0]
    padded = varlen.pad(x, lengths)
    assert padded.shape == (4, 113, 4, 16)
    for b, n in enumerate(lengths):
        assert torch.equal(padded[b, :n], x[varlen.cu_seqlens(lengths)[b]:][:n])
        assert not padded[b, n:].any()  # zeros after each sequence
    for layout, source in (("packed", x), ("nested", x), ("padded", padded)):
        view = varlen.view_as(layout, source, lengths)
        assert view.data_ptr() == source.data_ptr()  # a view, no copy
        assert torch.equal(varlen.unpack(layout, view, lengths), x)
    assert varlen.view_as("packed", x, lengths).shape == (4, 136, 16)
    assert varlen.view_as("padded", padded, lengths).shape == (4, 4, 113, 16)
    equal = (7,) * 3
    y = packed_inputs(equal, SMALL_HEADS[0])[0]
    dense = varlen.view_as("dense", y, equal)
    assert dense.shape == (3, 4, 7, 16) and dense.data_ptr() == y.data_ptr()
    assert torch.equal(dense[1, 2], y[7:14, 2])
    assert torch.equal(varlen.unpack("dense", dense, equal), y)
    with pytest.raises(ValueError, match="got 'ragged'"):
        varlen.view_as("ragged", x, lengths)


@pytest.mark.parametrize("heads", SMALL_HEADS, ids=lambda h: h.note)
def test_padded_sdpa_with_is_causal_alone_is_exact_on_the_real_tokens(heads):
    """The padded rows' claim: right padding + is_causal needs no mask, forward and backward
    (with dO zero on the padding)."""
    lengths = AWKWARD
    q, k, v, do = packed_inputs(lengths, heads)
    attend = host.sdpa_attend(torch, True, heads.group > 1)
    leaves = [varlen.view_as("padded", varlen.pad(x, lengths), lengths).requires_grad_()
              for x in (q, k, v)]
    o = attend(*leaves)
    np.testing.assert_allclose(varlen.unpack("padded", o, lengths).detach().numpy(),
                               packed_reference(q, k, v, lengths), atol=1e-12)
    grads = torch.autograd.grad(o, leaves, varlen.view_as("padded", varlen.pad(do, lengths), lengths))
    want = packed_reference(q, k, v, lengths, do=do)
    real = torch.zeros(len(lengths) * max(lengths), dtype=torch.bool)
    real[torch.as_tensor(varlen.padded_rows(lengths))] = True
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(varlen.unpack("padded", got, lengths).numpy(), expected, atol=1e-12)
        assert not got.transpose(1, 2).flatten(0, 1)[~real].any()  # nothing flows into the padding


@pytest.mark.parametrize("heads", SMALL_HEADS, ids=lambda h: h.note)
def test_nested_sdpa_matches_the_reference_per_sequence(heads):
    """The nested rows' call (k, v repeated to the query heads for GQA), forward and gradients.
    Not causal here: torch's CPU path for jagged tensors refuses is_causal; the GPU test runs
    it causal."""
    lengths = AWKWARD
    q, k, v, do = packed_inputs(lengths, heads)
    attend = varlen.sdpa_nested_attend(torch, lengths, heads.group, device="cpu", causal=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attend(*leaves)
    assert o.shape == q.shape
    np.testing.assert_allclose(o.detach().numpy(), packed_reference(q, k, v, lengths, causal=False),
                               atol=1e-12)
    grads = torch.autograd.grad(o, leaves, do)
    for got, expected in zip(grads, packed_reference(q, k, v, lengths, causal=False, do=do)):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)


def test_the_packed_call_is_missing_from_this_build_or_takes_cu_seqlens():
    import cuflash.torch

    attend = varlen.cuflash_packed_attend((3, 4), device="cpu")
    has = varlen.accepts_keyword(cuflash.torch.attention, "cu_seqlens_q")
    assert (attend is None) == (not has)


# ---- the table from fake timings ---------------------------------------------------------------

FAKE_MS = {"cuflash_packed": 2.0, "cuflash_padded": 5.0, "sdpa_flash_padded": 8.0,
           "sdpa_cudnn_padded": 4.0, "sdpa_flash_nested": 3.0, "cuflash_dense": 2.1}


def _per_sequence_attend(lengths):
    """cuflash's packed call as the test's stand-in: per-sequence causal SDPA on (H, total, d)."""
    cu = varlen.cu_seqlens(lengths)

    def attend(q, k, v):
        group = q.shape[0] // k.shape[0]
        parts = [torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b].repeat_interleave(group, 0), v[:, a:b].repeat_interleave(group, 0),
            is_causal=True) for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(parts, dim=1)

    return attend


@pytest.fixture
def fake_run(monkeypatch):
    """CPU stand-ins: float64 inputs; cuflash rows computed by torch on the CPU (the padded
    and dense rows through the real SDPA call, the packed one per sequence); SDPA flash rows
    as written (unpinned); SDPA cuDNN nested raising; time_call returning FAKE_MS once run."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    monkeypatch.setattr(common, "random_tensor",
                        lambda env, shape: torch.randn(shape, generator=gen, dtype=torch.float64))
    current = []
    real_attend_of = varlen.attend_of

    def attend_of(env, row, batch, heads):
        if row.name == "sdpa_cudnn_nested":
            def broken(q, k, v):
                raise RuntimeError("No available kernel. Aborting execution.")
            attend = broken
        elif row.layout == "packed":
            attend = _per_sequence_attend(batch.lengths)
        elif row.layout == "nested":
            attend = varlen.sdpa_nested_attend(torch, batch.lengths, heads.group, "cpu", causal=False)
        elif row.is_cuflash:
            attend = host.sdpa_attend(torch, True, heads.group > 1)
        else:
            attend = real_attend_of(env, row, batch, heads)[0]

        def tracked(*a):
            current.append(row.name)
            return attend(*a)

        return tracked, contextlib.nullcontext

    def fake_time_call(cupy, fn, input_sets, warmup, repeats):
        out = fn(*input_sets[0])
        return [FAKE_MS[current[-1]]] * 3, out

    monkeypatch.setattr(varlen, "attend_of", attend_of)
    monkeypatch.setattr(varlen, "time_call", fake_time_call)
    env = types.SimpleNamespace(cupy=types.SimpleNamespace(cuda=types.SimpleNamespace(
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))), torch=torch,
        torch_reason=None, l2_bytes=10**4, free_memory=lambda: None)
    return env


def _small_run(env, progress="[test]"):
    args = types.SimpleNamespace(warmup=1, repeats=3)
    return varlen.varlen_table(env, args, progress, heads=SMALL_HEADS,
                               mixed=varlen.Batch("mixed", AWKWARD), equal=((3, 8),))


def test_table_records_from_fake_timings(fake_run):
    lines = []
    progress = types.SimpleNamespace(start=lambda label: None, advance=lambda n=1: lines.append("+"),
                                     note=lines.append)
    records = _small_run(fake_run, progress)
    assert lines.count("+") == varlen.count_steps(SMALL_HEADS, ((3, 8),))
    assert [(r["heads_q"], r["batch"], r["mode"]) for r in records] == [
        (4, "mixed", "fwd"), (4, "mixed", "fwdbwd"), (4, "equal", "fwd"), (4, "equal", "fwdbwd"),
        (3, "mixed", "fwd"), (3, "mixed", "fwdbwd"), (3, "equal", "fwd"), (3, "equal", "fwdbwd")]
    mixed = records[0]
    assert list(mixed["backends"]) == [r.name for r in varlen.MIXED_ROWS]
    assert list(records[2]["backends"]) == ["cuflash_packed", "cuflash_dense"]
    heads = SMALL_HEADS[0]
    batch = varlen.Batch("mixed", AWKWARD)
    assert mixed["useful_flops"] == varlen.useful_flops(batch, heads, "fwd")
    assert records[1]["useful_flops"] == 3.5 * mixed["useful_flops"]
    assert mixed["pad_token_fraction"] == pytest.approx(1 - 136 / (4 * 113))
    assert mixed["tokens"] == 136 and mixed["longest"] == 113 and mixed["lengths"] == list(AWKWARD)
    for name, entry in mixed["backends"].items():
        if name == "sdpa_cudnn_nested":
            assert entry["status"] == "error" and "No available kernel" in entry["error"]
            assert entry["ms"] is None and entry["tflops"] is None
            continue
        assert entry["status"] == "ok" and entry["ms"] == FAKE_MS[name], (name, entry)
        assert entry["tflops"] == pytest.approx(mixed["useful_flops"] / (FAKE_MS[name] * 1e-3) / 1e12)
    # every row of the forward agrees with the packed one on the real tokens (the nested
    # stand-in is not causal, so it differs)
    diffs = mixed["max_abs_diff_vs_packed"]
    assert set(diffs) == {"cuflash_padded", "sdpa_flash_padded", "sdpa_cudnn_padded", "sdpa_flash_nested"}
    assert diffs["cuflash_padded"] < 1e-12 and diffs["sdpa_flash_padded"] < 1e-12
    assert diffs["sdpa_flash_nested"] > 1e-3
    assert records[2]["max_abs_diff_vs_packed"]["cuflash_dense"] < 1e-12
    assert records[1]["max_abs_diff_vs_packed"] == {}  # checked in the forward only
    assert varlen.cuflash_failures(records) == []
    assert any("max|o - o_packed|" in line for line in lines)


def test_a_failing_cuflash_row_is_a_failure(fake_run, monkeypatch):
    fake_attend_of = varlen.attend_of

    def attend_of(env, row, batch, heads):
        if row.name == "cuflash_dense":
            raise RuntimeError("cuflash kernel failed")
        return fake_attend_of(env, row, batch, heads)

    monkeypatch.setattr(varlen, "attend_of", attend_of)
    records = _small_run(fake_run)
    failures = varlen.cuflash_failures(records)
    assert len(failures) == 2 * 2  # two head layouts x two modes
    assert failures[0] == ("varlen 4/2 heads hdim 16 3 x 8 fwd: cuflash_dense",
                           "RuntimeError: cuflash kernel failed")
    text = varlen.format_varlen(records, common.Footnotes())
    assert "FAILED [" in text and "cuflash dense: RuntimeError: cuflash kernel failed" in text


def test_a_build_without_the_packed_call_shows_dashes(fake_run, monkeypatch):
    fake_attend_of = varlen.attend_of
    monkeypatch.setattr(varlen, "attend_of", lambda env, row, batch, heads: None
                        if row.layout == "packed" else fake_attend_of(env, row, batch, heads))
    records = _small_run(fake_run)
    assert all(r["backends"]["cuflash_packed"]["status"] == "unavailable" for r in records)
    assert varlen.cuflash_failures(records) == []
    assert all(r["max_abs_diff_vs_packed"] == {} for r in records)
    text = varlen.format_varlen(records, common.Footnotes())
    assert f"[1] {varlen.NOT_IN_BUILD}" in text
    row = next(line for line in text.splitlines() if "| SDPA flash" in line and "padded" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    saved = 4 * 113**2 / (1 + 17**2 + 113**2 + 5**2)  # padded / useful FLOPs: 3.90
    assert cells[7:] == [common.DASH, f">= {saved:.2f}x", common.DASH]  # no ratio, no verdict


def test_inputs_that_do_not_fit_fail_every_row_of_the_batch(fake_run, monkeypatch):
    def no_memory(env, shape):
        raise MemoryError("out of memory allocating 4294967296 bytes")

    monkeypatch.setattr(common, "random_tensor", no_memory)
    records = _small_run(fake_run)
    assert {e["status"] for r in records for e in r["backends"].values()} == {"oom"}
    assert len(varlen.cuflash_failures(records)) == 2 * 2 * (2 + 2)  # heads x modes x cuflash rows
    assert "making the inputs: MemoryError" in records[0]["backends"]["sdpa_flash_padded"]["error"]


def test_no_torch_makes_every_row_unavailable(fake_run):
    env = types.SimpleNamespace(**{**vars(fake_run), "torch": None,
                                   "torch_reason": "PyTorch is not available"})
    records = _small_run(env)
    assert {e["status"] for r in records for e in r["backends"].values()} == {"unavailable"}
    assert varlen.cuflash_failures(records) == []


def _fake_records():
    """The default batch's records for one head layout and mode, with chosen times."""
    heads = varlen.HEADS[0]
    mixed = varlen._record(varlen.mixed_batch(), heads, "fwd")
    equal = varlen._record(varlen.equal_batch(16, 4096), heads, "fwd")
    saved = mixed["padded_flops"] / mixed["useful_flops"]
    times = {"cuflash_packed": 10.0, "cuflash_padded": 25.0,
             "sdpa_flash_padded": 10.0 * saved + 1,  # just beats the target
             "sdpa_cudnn_padded": 10.0 * saved - 1}  # just misses it
    for name, ms in times.items():
        mixed["backends"][name] = varlen._entry(ms, times=[ms], flop=mixed["useful_flops"])
    mixed["backends"]["sdpa_flash_nested"] = varlen._entry(status="oom", error="OutOfMemoryError: x")
    mixed["backends"]["sdpa_cudnn_nested"] = varlen._entry(
        status="error", error="RuntimeError: No available kernel")
    for name, ms in (("cuflash_packed", 4.0), ("cuflash_dense", 3.9)):
        equal["backends"][name] = varlen._entry(ms, times=[ms], flop=equal["useful_flops"])
    return [mixed, equal], saved


def test_table_layout_ratios_targets_and_footnotes():
    records, saved = _fake_records()
    notes = common.Footnotes()
    text = varlen.format_varlen(records, notes)
    assert "varlen: forward, 32 query / 8 k-v heads (Llama-style GQA), head dim 128, bfloat16, causal" in text
    width = max(len(line) for line in text.splitlines())
    assert width <= common.CAPTION_WIDTH, f"the report is {width} columns wide"
    rows = {}
    for line in text.splitlines():
        if line.startswith("|") and ("mixed" in line or " x " in line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1], cells[2])] = cells[3:]
    mixed = records[0]
    pad = f"padded to {mixed['longest']}"
    tok, flop = (f"{100 * mixed[k]:.0f}%" for k in ("pad_token_fraction", "pad_flop_fraction"))
    tflops = f"{mixed['useful_flops'] / 10e-3 / 1e12:.0f}"
    assert rows[("64 mixed", "cuflash", "packed")] == ["10.000", tflops, "0%", "0%", "", "", ""]
    assert rows[("64 mixed", "cuflash", pad)][:5] == ["25.000", f"{mixed['useful_flops'] / 25e-3 / 1e12:.0f}", tok, flop, "2.50x"]
    assert rows[("64 mixed", "cuflash", pad)][5:] == ["", ""]
    flash = rows[("64 mixed", "SDPA flash", pad)]
    assert flash[4:] == [f"{saved + 0.1:.2f}x", f">= {saved:.2f}x", "met"]
    assert rows[("64 mixed", "SDPA cuDNN", pad)][4:] == [f"{saved - 0.1:.2f}x", f">= {saved:.2f}x", "missed"]
    assert rows[("64 mixed", "SDPA flash", "nested")][:2] == ["OOM", common.DASH]
    cudnn_nested = rows[("64 mixed", "SDPA cuDNN", "nested")]
    assert cudnn_nested[0] == f"{common.DASH} [1]" and cudnn_nested[4] == common.DASH
    assert "[1] SDPA cuDNN nested: RuntimeError: No available kernel" in text
    # equal lengths: dense 3.9 ms / packed 4.0 ms = 0.975x >= 0.95x
    assert rows[("16 x 4096", "cuflash", "dense")][4:] == ["0.97x", ">= 0.95x", "met"]
    caption = " ".join(text.split())
    assert f"64 sequences drawn uniformly from {min(mixed['lengths'])}..{max(mixed['lengths'])}" in caption
    for phrase in ("cu_seqlens_q=cu", "nested_tensor_from_jagged", "repeat_interleave",
                   "is_causal=True", "flash refuses masks", "dO zero on the padding"):
        assert phrase in caption, phrase


def test_json_and_csv_of_the_table(tmp_path):
    records, _ = _fake_records()
    notes = common.Footnotes()
    varlen.format_varlen(records, notes)
    results = {"settings": cli.settings(cli.parse_args([])),
               "varlen": {"settings": varlen.json_settings(), "records": records,
                          "footnotes": notes.texts}}
    cli.write_json(str(tmp_path / "r.json"), results)
    data = json.loads((tmp_path / "r.json").read_text())["varlen"]
    assert data["settings"]["mixed"]["lengths"] == list(varlen.mixed_batch().lengths)
    assert data["settings"]["mixed"]["seed"] == varlen.LENGTH_SEED
    assert data["settings"]["heads"][0] == {"q": 32, "kv": 8, "hdim": 128, "note": "Llama-style GQA"}
    first = data["records"][0]
    for key in ("batch", "lengths", "sequences", "tokens", "longest", "heads_q", "heads_kv",
                "hdim", "mode", "useful_flops", "padded_flops", "pad_token_fraction",
                "pad_flop_fraction", "backends", "max_abs_diff_vs_packed"):
        assert key in first, key
    assert first["backends"]["cuflash_packed"]["calls"] == 1  # times_ms became a count
    assert data["footnotes"] == ["SDPA cuDNN nested: RuntimeError: No available kernel"]
    rows = [r for r in cli.csv_rows(results) if r["table"] == "varlen"]
    assert len(rows) == 6 + 2
    packed = rows[0]
    assert (packed["backend"], packed["pattern"], packed["mode"], packed["batch"], packed["seqlen"],
            packed["heads"], packed["kv_heads"], packed["hdim"]) == (
        "cuflash_packed", "mixed", "fwd", 64, records[0]["longest"], 32, 8, 128)
    assert packed["flops"] == records[0]["useful_flops"] and packed["ms"] == 10.0
    assert rows[-1]["pattern"] == "equal" and rows[-1]["seqlen"] == 4096


def test_the_cli_runs_the_table_by_default():
    args = cli.parse_args([])
    assert "varlen" in args.tables
    assert args.tables.index("varlen") < args.tables.index("host")  # before JAX takes memory
    assert cli.count_steps(cli.parse_args(["--tables", "varlen"])) == 1 + varlen.count_steps()


def test_import_needs_neither_cupy_nor_torch():
    code = "import sys, cuflash.bench.varlen; print('cupy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False False"


# ---- on the GPU ----------------------------------------------------------------------------------


@requires_gpu
def test_varlen_table_runs_on_the_gpu():
    """The whole table at a small size: every cuflash row measured (the packed ones unless this
    build lacks the call), every peer that ran agreeing with packed cuflash on the real tokens
    to bf16 accuracy, the table within 120 columns."""
    env = common.setup_env("bfloat16")
    if env.torch is None:
        pytest.skip(env.torch_reason)
    args = types.SimpleNamespace(warmup=1, repeats=3)
    heads = (varlen.Heads(4, 2, 128, "tiny GQA"), varlen.Heads(3, 3, 64, "tiny MHA"))
    with env.stream():
        records = varlen.varlen_table(env, args, "[test]", heads=heads,
                                      mixed=varlen.Batch("mixed", (1, 17, 113, 300, 64)),
                                      equal=((3, 256),))
    assert varlen.cuflash_failures(records) == []
    packed_ok = varlen.cuflash_packed_attend((1,)) is not None
    for r in records:
        for name, entry in r["backends"].items():
            if name == "cuflash_packed":
                assert entry["status"] == ("ok" if packed_ok else "unavailable"), entry
            elif name.startswith("cuflash"):
                assert entry["status"] == "ok" and entry["ms"] > 0, (name, entry)
            else:
                assert entry["status"] in ("ok", "error", "unavailable"), (name, entry)
        for name, diff in r["max_abs_diff_vs_packed"].items():
            # two bf16 computations of o (|o| <= max |v| ~ 4): the speed table's warning bound
            assert diff < speed.CHECK_WARN, (r["label"], r["heads_q"], name, diff)
        if packed_ok and r["mode"] == "fwd":
            assert r["max_abs_diff_vs_packed"].get("cuflash_padded" if r["batch"] == "mixed"
                                                   else "cuflash_dense") is not None
    text = varlen.format_varlen(records, common.Footnotes())
    assert max(len(line) for line in text.splitlines()) <= common.CAPTION_WIDTH
