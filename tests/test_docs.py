"""The README and docs/ say what is true of the tree they ship with: the README stays a short
page a newcomer can follow (at most 200 lines, quick starts of at most 15 lines, no kernel
jargon), its figures are the benchmark file's at the commit it names, its counts and commands
are the code's, every link resolves, and no page speaks of how the project was made."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
RESULTS = REPO_ROOT / "bench" / "results" / "h100.md"


def fenced_blocks(text: str) -> list:
    """(language, lines) of each ``` block."""
    return [(lang, body.splitlines()) for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def sections(text: str) -> dict:
    """'## title' -> that section's text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_a_quick_start_per_framework_of_at_most_15_lines():
    found = {title: body for title, body in sections(README.read_text()).items() if title.startswith("Quick start")}
    assert set(found) == {"Quick start: CuPy", "Quick start: PyTorch", "Quick start: JAX"}
    for title, body in found.items():
        blocks = [lines for lang, lines in fenced_blocks(body) if lang == "python"]
        assert len(blocks) == 1, title
        assert len(blocks[0]) <= 15, (title, len(blocks[0]))


@pytest.mark.parametrize("block", [i for i, (lang, _) in enumerate(fenced_blocks(README.read_text()))
                                   if lang == "python"])
def test_the_readmes_python_compiles(block):
    _, lines = fenced_blocks(README.read_text())[block]
    compile("\n".join(lines), f"README.md python block {block}", "exec")


def test_no_kernel_jargon_in_the_readme():
    text = README.read_text()
    for word in ("wgmma", "TMA", "CTA", "m16n8k16", "warpgroup", "mma.sync", "ldmatrix", "cp.async"):
        assert not re.search(rf"\b{re.escape(word)}\b", text, re.I), word


def test_every_relative_link_resolves():
    checked = 0
    for page in PAGES:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), (page.name, link)
                checked += 1
    assert checked >= 10  # the README's links to docs/ alone are more


def test_the_readme_has_no_image_a_package_index_cannot_show():
    """A package index shows the README without the repository's files beside it."""
    assert not re.search(r"!\[[^]]*\]\((?![a-z]+://)", README.read_text())


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)\)", README.read_text()))
    assert linked == {p.name for p in DOCS}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_speaks_of_how_the_project_was_made(page):
    text = page.read_text()
    for pattern in (r"\bsessions?\b", r"device time", r"\blent\b", r"\bloans?\b", r"\$OUT\b", r"this machine"):
        assert not re.search(pattern, text, re.I), (page.name, pattern)


def test_the_speed_table_is_the_benchmark_files_at_the_commit_it_names():
    results = RESULTS.read_text()
    commit = re.search(r"^cuflash commit (\w+)", results, re.M).group(1)
    speed = sections(README.read_text())["Speed"]
    assert f"commit {commit}" in speed
    rows = re.findall(r"^\| (\d+) \| (no|yes) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", speed, re.M)
    assert len(rows) == 4
    for hdim, causal, tflops, vs_flash, vs_cudnn in rows:
        table = results.split(f"forward + backward, causal={causal}, head dim {hdim}, bfloat16\n")[1]
        cells = [c.strip() for c in re.search(r"^\|\s+16384 \|.*$", table, re.M).group(0).strip("|").split("|")]
        assert round(float(cells[3])) == int(tflops), (hdim, causal, cells)
        assert (cells[6], cells[7]) == (f"{vs_flash}x", f"{vs_cudnn}x"), (hdim, causal, cells)


def test_the_variant_counts_are_the_dispatchers():
    from cuflash import _config

    setup = sections(README.read_text())["Set-up"]
    ampere, hopper = re.search(r"\((\d+) on Ampere and Ada, (\d+) on Hopper\)", setup).groups()
    assert int(ampere) == len(_config.variants_for("sm_80")) == len(_config.variants_for("sm_89"))
    assert int(hopper) == len(_config.variants_for("sm_90a"))


def test_the_readmes_commands_exist():
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    text = "\n".join(page.read_text() for page in PAGES)
    for group in re.findall(r'"(?:\.|cuflash)\[([\w,]+)\]"', text):
        assert set(group.split(",")) <= extras, group
    assert "cuflash-compile-check --warm" in README.read_text()
    out = subprocess.run([sys.executable, "-m", "cuflash.compile_check", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--warm" in out.stdout
    assert 'python -m pytest -m "not nvrtc" tests -q' in README.read_text()
    markers = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("nvrtc:") for m in markers)
