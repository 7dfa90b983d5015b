"""scripts/racecheck_hazards.py: parsing racecheck's reports, naming their variants, sorting them
by the instructions at their offsets (a stand-in disassembly without NVRTC, a real cubin with it),
and sanitize_cases.py keeping the cubins CuPy loads."""

import pytest

from conftest import load_script

KERNEL = ("void cuflash::flash_bwd_sm90_kernel<cuflash::Bwd90Traits<cuflash::bf16, (int)128, (bool)1, (bool)1, "
          "(int)2, (bool)0, (bool)1, (bool)0, (bool)1, (bool)0, (int)199208>>(cuflash::FwdParams, "
          "cuflash::BwdParams, cuflash::sm90::Bwd90Maps)")
KEY = "bwd_sm90_bf16_d128_s2_atomic_dq_causal_varlen_tma"


def report(write, reads, first="Write", hazards=64):
    """A race report as racecheck prints it (the format of its logs)."""
    lines = [f"========= Error: Race reported between {first} access at {KERNEL}+{write:#x}"]
    other = "Read" if first == "Write" else "Write"
    lines += [f"=========     and {other} access at {KERNEL}+{r:#x} [{hazards} hazards]" for r in reads]
    return "\n".join(lines + ["========= "])


def summary(displayed, errors, warnings=0):
    return f"========= RACECHECK SUMMARY: {displayed} hazards displayed ({errors} errors, {warnings} warnings)"


# A stand-in kernel: the statistics' bulk copy inside its elect loop, a cp.async, a shared store.
SASS = {0x100: "PLOP3.LUT P1, PT, PT, PT, PT, 0x8, 0x0", 0x110: "UBLKCP.S.G [UR16], [UR10], UR8",
        0x120: "@P0 BRA.U.ANY 0xf0", 0x200: "LDGSTS.E.BYPASS.128 [R13+0x28000], desc[UR14][R2.64]",
        0x210: "BRA 0x300", 0x300: "STS [R3], R4", 0x310: "IADD3 R1, R1, 0x1, RZ",
        0x400: "LDS.64 R190, [R190]", 0x410: "LDS.64 R188, [R194+0x8]", 0x420: "FMUL R157, R157, UR42"}


@pytest.fixture(scope="module")
def hazards():
    return load_script("racecheck_hazards")


def test_reports_and_summaries_are_parsed(hazards):
    text = "\n".join(["Case(...) ok 1.3 s", report(0xf680, (0x31a0, 0x31e0)), summary(1, 1), "==== shard 1/2",
                      "========= Warning: Maximum number of hazards reached. Environment variable ...",
                      report(0xf790, (0x4970,), hazards=3), summary(2, 5, 1)])
    log = hazards.parse_log(text)
    assert (log.displayed, log.total, log.hazard_limit) == (3, 7, 1)
    assert [[(a.kind, a.offset, a.hazards) for a in r] for r in log.reports] == [
        [("Write", 0xf680, 0), ("Read", 0x31a0, 64), ("Read", 0x31e0, 64)], [("Write", 0xf790, 0), ("Read", 0x4970, 3)]]
    assert log.reports[0][0].kernel == KERNEL


def test_a_kernel_as_racecheck_names_it_is_its_variant(hazards):
    assert hazards.variant_names()[hazards.name_expression(KERNEL)] == KEY
    assert hazards.name_expression("void k<(int)-3, (unsigned int)4, (bool)0>(int)") == "k<-3,4,false>"


@pytest.mark.parametrize("write, reads, first, verdict", (
    (0x100, (0x400, 0x410), "Write", "async copy"),  # the instruction before the bulk copy
    (0x120, (0x400,), "Write", "async copy"),  # the one after it
    (0x200, (0x400,), "Write", "async copy"),  # the cp.async itself
    (0x400, (0x210,), "Read", "async copy"),  # a report may start with its read
    (0x300, (0x400,), "Write", "other"),  # a thread's store
    (0x310, (0x400,), "Write", "other"),  # next to the store, no copy
    (0x100, (0x420,), "Write", "other"),  # a read that is no memory access: not the run's machine code
))
def test_only_writes_of_async_copies_against_memory_reads_are_sorted_apart(hazards, write, reads, first, verdict):
    accesses = hazards.parse_log(report(write, reads, first)).reports[0]
    assert hazards.classify(accesses, SASS)[0] == verdict
    assert hazards.classify(accesses, "2 functions in x.cubin") == ("other", "2 functions in x.cubin")


def _run(hazards, monkeypatch, tmp_path, capsys, text, cubins=(KEY,)):
    monkeypatch.setattr(hazards, "kernel_sass", lambda cubin, workdir: SASS)
    for key in cubins:
        (tmp_path / f"{key}.cubin").write_bytes(b"")
    log = tmp_path / "racecheck.log"
    log.write_text(text)
    status = hazards.main(["--cubins", str(tmp_path), str(log)])
    return status, capsys.readouterr().out.splitlines()


def test_a_log_of_async_copy_writes_passes(hazards, monkeypatch, tmp_path, capsys):
    text = "\n".join([report(0x100, (0x400, 0x410)), report(0x200, (0x400,)), summary(2, 2)])
    status, out = _run(hazards, monkeypatch, tmp_path, capsys, text)
    assert status == 0 and out[0].startswith(f"async copy: {KEY} +0x100: write UBLKCP.S.G, 2 x LDS.64")
    assert out[-1] == ("race reports 2: 2 of async-copy writes racecheck cannot order (192 hazards, 1 variants), "
                       "0 other (0 hazards)")


@pytest.mark.parametrize("text, cubins, failure", (
    ("\n".join([report(0x100, (0x400,)), report(0x300, (0x400,)), summary(2, 2)]), (KEY,), "1 other races"),
    ("\n".join([report(0x100, (0x400,)), summary(1, 1)]), (), "1 other races"),  # no cubin of it
    ("\n".join([report(0x100, (0x400,)), summary(1, 4)]), (KEY,), "3 hazards not displayed"),
    ("\n".join([report(0x100, (0x400,)), "========= Warning: Maximum number of hazards reached.", summary(2, 1, 1)]),
     (KEY,), "1 processes reached racecheck's hazard limit"),
))
def test_other_races_and_unsorted_hazards_fail(hazards, monkeypatch, tmp_path, capsys, text, cubins, failure):
    status, out = _run(hazards, monkeypatch, tmp_path, capsys, text, cubins)
    assert status == 1 and "; FAILED: " in out[-1] and failure in out[-1]


@pytest.mark.nvrtc
def test_the_key_pass_statistics_copies_against_their_reads(hazards, monkeypatch, tmp_path, capsys):
    """The wgmma key pass's cubin, disassembled: reports of its bulk copies' writes (racecheck
    names the instruction before each) against its LDS.64 reads are async-copy writes, and one
    whose write is its dS^T store (STS) is not."""
    from cuflash import _config, _loader

    variant = next(v for v in _config.variants_for("sm_90a") if v.key == KEY)
    options = (*_loader.base_options(), "-arch=sm_90a")
    _, _, cubin = _loader.nvrtc_build(_loader.read_source(variant.source), variant.source,
                                      [variant.name_expression], options, want_cubin=True)
    (tmp_path / f"{KEY}.cubin").write_bytes(cubin)
    sass = hazards.kernel_sass(tmp_path / f"{KEY}.cubin", tmp_path)
    copies = [a for a, i in sorted(sass.items()) if i.startswith("UBLKCP.S.G")]
    reads = [a for a, i in sorted(sass.items()) if i.startswith("LDS.64")][:16]
    store = next(a for a, i in sorted(sass.items()) if i.startswith("STS "))
    assert len(copies) == 2 and len(reads) == 16  # (m, log2 l) and D: two copies a stage
    log = tmp_path / "racecheck.log"
    log.write_text("\n".join([report(copies[0] - 16, reads), report(copies[1] - 16, reads[:8]), summary(2, 2)]))
    assert hazards.main(["--cubins", str(tmp_path), str(log)]) == 0
    log.write_text("\n".join([report(store, reads), summary(1, 1)]))
    assert hazards.main(["--cubins", str(tmp_path), str(log)]) == 1
    assert capsys.readouterr().out.splitlines()[-2].startswith(f"other: {KEY} +{store:#x}: write at")


def test_the_cubins_cupy_loads_are_kept_by_variant(tmp_path):
    """sanitize_cases --cubins: what CuPy's kernel cache hands over while a variant is built is
    its cubin (a payload of its mangled name, then the cubin); the cache is CuPy's own again
    after the block."""
    from cupy.cuda import compiler

    cases = load_script("sanitize_cases")
    cubin = b"\x7fELF stand-in"

    class Stored:
        saved = []

        def load(self, name):
            return compiler._encode_cache_payload(["_Z6kernelv"], cubin) if name == "cached" else None

        def save(self, name, payload, source):
            self.saved.append(name)

    stored, before = Stored(), compiler._kernel_cache_backend
    compiler._set_kernel_cache_backend(stored)
    try:
        cubins, building = {}, []
        with cases.recording_cubins(cubins, building):
            assert compiler._kernel_cache_backend.load("cached") is not None  # outside a build: not kept
            building.append("a")
            compiler._kernel_cache_backend.load("cached")
            building[-1] = "b"
            assert compiler._kernel_cache_backend.load("missing") is None
            compiler._kernel_cache_backend.save("new", compiler._encode_cache_payload(["_Z1bv"], cubin + b"!"), "")
        assert compiler._kernel_cache_backend is stored and stored.saved == ["new"]
    finally:
        compiler._set_kernel_cache_backend(before)
    assert cubins == {"a": cubin, "b": cubin + b"!"}
    cases.write_cubins(cubins, tmp_path / "cubins")
    assert (tmp_path / "cubins" / "b.cubin").read_bytes() == cubin + b"!"
    assert sorted(p.name for p in (tmp_path / "cubins").iterdir()) == ["a.cubin", "b.cubin"]
