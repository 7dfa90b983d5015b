"""A missing dependency is one line naming the pip extra that installs it, wherever it surfaces:
cuflash.attention without CuPy, cuflash.torch / cuflash.jax without their framework (or CuPy),
cuflash-bench and cuflash-compile-check without CuPy; and those extras exist in pyproject.toml.

Each case runs in a fresh interpreter in which the module is made unimportable
(``sys.modules[name] = None``), so it holds on a machine that has everything installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _requirements

REPO_ROOT = Path(__file__).resolve().parent.parent
CUPY_HINT = 'pip install "cuflash[cuda12]" for a CUDA 12 driver, "cuflash[cuda13]" for CUDA 13'
NO_GPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the no-device path on a GPU machine too


def run_python(code: str, *, hide=(), env=None, pythonpath=None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in which each module of ``hide`` cannot be imported."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hide)
    env = dict(env or os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO_ROOT)])
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---- the API without CuPy ------------------------------------------------------------------


def test_import_without_cupy_works_and_loads_no_cupy():
    out = run_python("import cuflash, cuflash.masks, cuflash.reference\n"
                     "print('cupy' in sys.modules and sys.modules['cupy'] is not None)", hide=["cupy"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("call", ["cuflash.attention(q, q, q, causal=True)",
                                  "cuflash.attention_backward(q, q, q, q, q, l, l)"])
def test_a_call_without_cupy_names_the_extra(call):
    code = ("import numpy as np, cuflash\n"
            "q = np.zeros((2, 8, 64), np.float16); l = np.zeros((2, 8), np.float32)\n"
            f"{call}\n")
    out = run_python(code, hide=["cupy"])
    assert out.returncode == 1
    name = call.split("(")[0]
    assert last_line(out.stderr) == f"ModuleNotFoundError: {name} needs CuPy, which is not installed: {CUPY_HINT}"


def test_merge_runs_without_cupy():
    """merge takes NumPy arrays, so it is left without the CuPy check."""
    code = ("import numpy as np, cuflash\n"
            "o = np.ones((1, 2, 4), np.float32); l = np.ones((1, 2), np.float32); m = np.zeros((1, 2), np.float32)\n"
            "print(cuflash.merge(o, l, m, 3 * o, l, m).o[0, 0, 0])")
    out = run_python(code, hide=["cupy"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


def test_with_cupy_the_public_functions_are_the_plain_ones():
    """The check costs nothing where CuPy is installed: no wrapper around the call."""
    if not _requirements.installed("cupy"):
        pytest.skip("CuPy is not installed here")
    import cuflash
    from cuflash import _api

    assert cuflash.attention is _api.attention
    assert cuflash.attention_backward is _api.attention_backward


def test_a_cupy_installed_after_import_is_found(monkeypatch):
    calls = []
    checked = _requirements.needs_cupy(lambda *args: calls.append(args) or "ran")
    monkeypatch.setattr(_requirements, "installed", lambda name: False)
    with pytest.raises(ModuleNotFoundError, match=re.escape(CUPY_HINT)) as error:
        checked(1)
    assert error.value.name == "cupy" and calls == []
    monkeypatch.setattr(_requirements, "installed", lambda name: True)
    assert checked(1) == "ran" and calls == [(1,)]


def test_installed_does_not_import():
    out = run_python("from cuflash import _requirements\n"
                     "print(_requirements.installed('cupy'), _requirements.installed('no_such_module_here'), "
                     "_requirements.installed('no_such_package.sub'), 'cupy' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1:] == ["False", "False", "False"]


# ---- the adapters without their framework --------------------------------------------------


@pytest.mark.parametrize("adapter, framework, extra", [("cuflash.torch", "torch", "torch"),
                                                       ("cuflash.jax", "jax", "jax")])
def test_an_adapter_without_its_framework_names_its_extra(adapter, framework, extra):
    out = run_python(f"import {adapter}", hide=[framework])
    assert out.returncode == 1
    line = last_line(out.stderr)
    assert line.startswith(f"ModuleNotFoundError: {adapter} needs "), line
    assert line.endswith(f'which is not installed: pip install "cuflash[{extra}]"'), line


def test_a_jax_without_buffer_callback_names_the_version(tmp_path):
    """A JAX older than the adapter's floor lacks jax.experimental.buffer_callback."""
    old_jax = tmp_path / "jax"
    (old_jax / "experimental").mkdir(parents=True)
    (old_jax / "__init__.py").write_text("")
    (old_jax / "experimental" / "__init__.py").write_text("")
    out = run_python("import cuflash.jax", pythonpath=tmp_path)
    assert out.returncode == 1
    assert last_line(out.stderr) == ("ModuleNotFoundError: cuflash.jax needs JAX 0.6.1 or later "
                                     '(jax.experimental.buffer_callback), which is not installed: '
                                     'pip install "cuflash[jax]"')


def test_an_adapter_without_cupy_names_the_cupy_extra():
    """With its framework present but CuPy missing (torch is the framework tests have most)."""
    if not _requirements.installed("torch"):
        pytest.skip("PyTorch is not installed here")
    out = run_python("import cuflash.torch", hide=["cupy"])
    assert out.returncode == 1
    assert last_line(out.stderr) == f"ModuleNotFoundError: cuflash.torch needs CuPy, which is not installed: {CUPY_HINT}"


def test_an_error_inside_the_framework_is_left_as_it_is():
    """A module missing inside an installed framework is not a missing framework."""
    inner = ModuleNotFoundError("No module named 'sympy'", name="sympy")
    assert _requirements.framework_error(inner, "cuflash.torch") is inner
    outer = ModuleNotFoundError("No module named 'jaxlib'", name="jaxlib")
    assert 'pip install "cuflash[jax]"' in str(_requirements.framework_error(outer, "cuflash.jax"))


# ---- the commands without CuPy -------------------------------------------------------------


def test_bench_without_cupy_prints_the_io_table_and_one_line():
    out = run_python("from cuflash.bench import cli\nsys.exit(cli.main([]))", hide=["cupy"])
    assert out.returncode == 2
    assert "IO: GPT-2 medium attention" in out.stdout
    assert out.stderr == ("cuflash-bench: speed, memory, sparse, decode, varlen, host, e2e: not run, they need a "
                          f"CUDA GPU (CuPy is not installed: {CUPY_HINT}). cuflash-bench --tables io runs "
                          "without one.\n")


def test_bench_io_table_without_cupy_succeeds():
    out = run_python("from cuflash.bench import cli\nsys.exit(cli.main(['--tables', 'io']))", hide=["cupy"])
    assert out.returncode == 0, out.stderr
    assert "IO: GPT-2 medium attention" in out.stdout and out.stderr == ""


@pytest.mark.parametrize("argv", [[], ["--warm"]])
def test_compile_check_without_cupy_is_one_line(argv):
    out = run_python(f"from cuflash import compile_check\nsys.exit(compile_check.main({argv!r}))", hide=["cupy"])
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == f"cuflash-compile-check needs CuPy, which is not installed: {CUPY_HINT}\n"


def test_compile_check_warm_without_a_gpu_is_one_line():
    if not _requirements.installed("cupy"):
        pytest.skip("CuPy is not installed here")
    out = run_python("from cuflash import compile_check\nsys.exit(compile_check.main(['--warm']))", env=NO_GPU_ENV)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("cuflash-compile-check: --warm builds for the GPU at hand: no "), out.stderr


# ---- the extras the messages name ------------------------------------------------------------


def extras() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_every_extra_a_message_names_exists():
    named = set(re.findall(r'"cuflash\[(\w+)\]"', _requirements.CUPY_INSTALL))
    named |= {extra for _, _, extra in _requirements.FRAMEWORKS.values()}
    assert named == {"cuda12", "cuda13", "torch", "jax"}
    assert named <= set(extras())


def test_all_holds_cupy_both_frameworks_transformers_and_matplotlib_with_floors():
    table = extras()
    assert table["all"] == ["cuflash[cuda12,torch,jax,transformers,plot]"]
    resolved = []
    for extra in ("cuda12", "torch", "jax", "transformers", "plot"):
        resolved += table[extra]
    names = {re.split(r"[\[<>=]", requirement)[0]: requirement for requirement in resolved}
    for name in ("cupy-cuda12x", "torch", "jax", "transformers", "matplotlib"):
        assert ">=" in names[name], (name, names[name])
    assert names["jax"].startswith("jax[cuda12]>=")


def test_the_jax_floor_is_the_one_the_message_names():
    floor = re.search(r"jax\[cuda12\]>=([\d.]+)", " ".join(extras()["jax"])).group(1)
    assert _requirements.FRAMEWORKS["cuflash.jax"][0].startswith(f"JAX {floor} or later")


def test_license_file_is_the_bsd_3_clause_that_pyproject_names():
    text = (REPO_ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n") and "Copyright (c) the cuflash authors" in text
    assert 'license = { text = "BSD-3-Clause" }' in (REPO_ROOT / "pyproject.toml").read_text()
