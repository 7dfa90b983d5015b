"""scripts/gpu_suite.sh and scripts/sanitize.sh without a GPU: their arguments, where their logs
go and the summary they print last. python3, nvidia-smi and compute-sanitizer are stand-ins on
PATH that record their arguments, so each run takes a fraction of a second."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
echo "stand-in $(basename "$0") $1 $2"
"""


@pytest.fixture
def run_script(tmp_path, monkeypatch):
    """run_script(name, *args) -> (CompletedProcess, the stand-ins' calls, one a line), started
    in tmp_path/work with an OUT variable that the scripts must not use."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for name in ("python3", "nvidia-smi", "compute-sanitizer"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls),
               OUT=str(tmp_path / "not-used"))
    for knob in ("TEST_LIST", "TEST_MARKERS", "BENCH_ARGS", "SANITIZE_SHARDS"):
        env.pop(knob, None)

    def run(name, *args):
        done = subprocess.run(["bash", str(SCRIPTS / name), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=60)
        assert not (tmp_path / "not-used").exists(), "the script wrote to $OUT"
        return done, calls.read_text().splitlines() if calls.exists() else []

    run.work = work
    return run


def test_gpu_suite_default_stages_write_to_out_folder(run_script):
    done, calls = run_script("gpu_suite.sh", "--out", "logs")
    assert done.returncode == 0, done.stderr
    logs = run_script.work / "logs"  # relative to where the script was started
    assert {"env.txt", "tests.log", "bench.md"} <= {p.name for p in logs.iterdir()}
    ran = [c for c in calls if c.startswith("python3 -m ")]
    assert [c.split()[2] for c in ran] == ["cuflash.compile_check", "pytest", "bench"]
    assert "-m not nvrtc" in ran[1] and f"--json {logs}/bench.json" in ran[2]
    summary = done.stdout[done.stdout.index("== summary =="):].splitlines()
    assert [line.split(":")[0] for line in summary[-3:]] == ["warm", "tests (not nvrtc)", "bench"]
    assert f"{logs}/bench.md" in summary[-1]


def test_gpu_suite_chosen_stage_and_default_folder(run_script):
    done, calls = run_script("gpu_suite.sh", "warm")
    assert done.returncode == 0, done.stderr
    assert (run_script.work / "gpu-logs" / "env.txt").is_file()
    assert [c for c in calls if c.startswith("python3 -m ")] == ["python3 -m cuflash.compile_check --warm"]
    assert done.stdout.splitlines()[-1].startswith("warm: stand-in python3 -m cuflash.compile_check")


@pytest.mark.parametrize("script, good", (("gpu_suite.sh", "warm"), ("sanitize.sh", "memcheck")))
@pytest.mark.parametrize("bad, message", ((["bnech"], "unknown argument bnech"),
                                          (["--outdir", "x"], "unknown argument --outdir"),
                                          (["--out"], "--out needs a folder"),
                                          (["--out", ""], "--out needs a folder")))
def test_bad_arguments_fail_before_anything_runs(run_script, script, good, bad, message):
    done, calls = run_script(script, good, *bad)
    assert done.returncode == 2
    assert message in done.stderr and "usage: scripts/" in done.stderr
    assert calls == [] and list(run_script.work.iterdir()) == []


def test_sanitize_tools_write_to_out_folder(run_script):
    done, calls = run_script("sanitize.sh", "--out", "san", "memcheck", "racecheck")
    assert done.returncode == 0, done.stderr
    logs = run_script.work / "san"
    assert {"warm.log", "memcheck.log", "racecheck.log"} <= {p.name for p in logs.iterdir()}
    sanitized = [c for c in calls if c.startswith("compute-sanitizer --tool ")]
    assert len(sanitized) == 2 * 4  # SANITIZE_SHARDS' default of 4 shards a tool
    assert sum("--tool memcheck --error-exitcode 1 " in c and "--subset all" in c for c in sanitized) == 4
    # racecheck: every report displayed, the cubins kept, and racecheck_hazards.py the judge
    racecheck = [c for c in sanitized if "--tool racecheck" in c]
    assert len(racecheck) == 4 and all("--subset one" in c and "--print-limit 0 " in c and "--cubins " in c
                                       and "--error-exitcode" not in c for c in racecheck)
    sorted_by = [c for c in calls if c.startswith("python3 scripts/racecheck_hazards.py")]
    assert len(sorted_by) == 1 and sorted_by[0].endswith(f"{logs}/racecheck.log")
    assert (logs / "racecheck-hazards.txt").is_file()
    lines = done.stdout.splitlines()
    assert lines[-3] == f"== compute-sanitizer (logs in {logs}) =="
    assert lines[-2].startswith("memcheck (all, 4 shards): rc=0")
    assert lines[-1].startswith("racecheck (one, 4 shards): rc=0")
