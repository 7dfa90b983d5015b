"""scripts/reliability.sh without a GPU (python3, nvidia-smi and compute-sanitizer are the
stand-ins of tests/test_suite_scripts.py): what it runs, where its logs go, and its summary."""

from test_suite_scripts import run_script  # noqa: F401  (the fixture)


def test_every_stage_runs_and_logs_to_the_folder(run_script):  # noqa: F811
    done, calls = run_script("reliability.sh", "rel")
    logs = run_script.work / "rel"
    assert {"env.txt", "warm.log", "tests.log", "soak.log", "summary.txt", "sanitize", "sanitize-sync"} <= {
        p.name for p in logs.iterdir()}
    ran = [c for c in calls if c.startswith("python3 ")]
    assert "python3 -m cuflash.compile_check --warm" in ran
    pytest_call = next(c for c in ran if c.startswith("python3 -m pytest"))
    assert all(f"tests/{name}.py" in pytest_call for name in ("test_fuzz_gpu", "test_bad_inputs", "test_validate"))
    assert f"python3 scripts/soak.py --seconds 120 --out {logs}/soak" in ran
    sanitized = [c for c in calls if c.startswith("compute-sanitizer ")]
    for tool in ("memcheck", "initcheck", "synccheck", "racecheck"):
        assert sum(f"--tool {tool} " in c for c in sanitized) == 6  # SANITIZE_SHARDS' default here
    # The stand-in soak writes no summary: the run fails, and says so last.
    assert done.returncode == 1
    summary = (logs / "summary.txt").read_text().splitlines()
    assert summary[0] == f"== reliability (logs in {logs}) =="
    assert any(line.startswith("memcheck (all, 6 shards)") for line in summary)
    assert any(line.startswith("racecheck (one, 6 shards)") for line in summary)
    assert any(line.startswith("soak: rc=0, no summary") for line in summary)
    assert summary[-1].endswith("FAIL") and done.stdout.splitlines()[-1] == summary[-1]


def test_the_folder_may_follow_out_and_is_required(run_script):  # noqa: F811
    done, before = run_script("reliability.sh", "--out", "rel")
    assert (run_script.work / "rel" / "summary.txt").is_file()
    for bad in ((), ("a", "b"), ("--out",), ("",)):
        done, calls = run_script("reliability.sh", *bad)
        assert done.returncode == 2 and "usage: scripts/reliability.sh" in done.stderr
        assert calls == before  # nothing ran
