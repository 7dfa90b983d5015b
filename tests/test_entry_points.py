"""attention_varlen and attention_with_kvcache of every front end (cuflash, cuflash.torch,
cuflash.jax) without a GPU: their signatures (the required arguments positional, another
mode's keywords refused), their own check, and the exact call each makes of its front end's
attention, which a recorder stands in for. The torch and JAX cases are skipped without their
framework. The calls themselves are tested in test_entry_points_gpu.py (CuPy),
test_entry_points_torch.py and test_entry_points_jax.py."""

import importlib
import os

import pytest

import cuflash
from cuflash import _api
from entry_util import (KVCACHE_REQUIRED, VARLEN_REQUIRED, Marker, Recorder, check_passes_on,
                        check_refuses_other_modes, markers, other_modes_keywords)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # should JAX start a GPU later in the run

REQUIRED = {"varlen": VARLEN_REQUIRED, "kvcache": KVCACHE_REQUIRED}
ENTRY_NAMES = {"varlen": "attention_varlen", "kvcache": "attention_with_kvcache"}
# Each keyword of a mode: (its default, another value). The front ends share these ...
KEYWORDS = {
    "varlen": dict(causal=(False, True), scale=(None, 0.25), window=(None, (7, 0))),
    "kvcache": dict(page_table=(None, Marker("page_table")), seqlens_k=(None, Marker("seqlens_k")),
                    num_splits=(None, 3), causal=(False, True), scale=(None, 0.5), window=(None, (100, 0))),
}
# ... and add their own: CuPy writes into given outputs, torch returns the statistics on request,
# JAX's packed batch has deterministic gradients on request (torch's follow torch's own flag).
FRONT_END_KEYWORDS = {
    "cupy": {"varlen": dict(out=(None, Marker("out"))), "kvcache": dict(out=(None, Marker("out")))},
    "torch": {"varlen": dict(return_stats=(False, True)), "kvcache": dict(return_stats=(False, True))},
    "jax": {"varlen": dict(deterministic=(False, True)), "kvcache": {}},
}
FRONT_ENDS = tuple(FRONT_END_KEYWORDS)


def front_end(name):
    """(the module whose ``attention`` the entry points call, the module exporting them, the
    prefix of their names in docstrings); skips the test without the framework."""
    if name == "cupy":
        return _api, cuflash, "cuflash"
    pytest.importorskip(name)
    module = importlib.import_module(f"cuflash.{name}")
    return module, module, f"cuflash.{name}"


@pytest.fixture(params=FRONT_ENDS)
def front(request, monkeypatch):
    """(the front end's real attention, its module of entry points, the recorder standing in for
    attention, the front end's name)."""
    owner, exports, _ = front_end(request.param)
    attention, recorder = owner.attention, Recorder()
    monkeypatch.setattr(owner, "attention", recorder)
    return attention, exports, recorder, request.param


@pytest.mark.parametrize("given", ("defaults", "every_keyword"))
@pytest.mark.parametrize("mode", REQUIRED)
def test_passes_its_arguments_on(front, mode, given):
    _, exports, recorder, name = front
    keywords = {**KEYWORDS[mode], **FRONT_END_KEYWORDS[name][mode]}
    defaults = {key: default for key, (default, _) in keywords.items()}
    values = {key: value for key, (_, value) in keywords.items()} if given == "every_keyword" else {}
    check_passes_on(getattr(exports, ENTRY_NAMES[mode]), REQUIRED[mode], recorder, defaults, **values)


@pytest.mark.parametrize("mode", REQUIRED)
def test_keywords_of_other_modes_are_refused_by_signature(front, mode):
    attention, exports, recorder, _ = front
    required = REQUIRED[mode]
    check_refuses_other_modes(getattr(exports, ENTRY_NAMES[mode]), required, attention, recorder,
                              markers(*required).values())


@pytest.mark.parametrize("missing", ("cu_seqlens_q", "cu_seqlens_k"))
def test_varlen_refuses_missing_boundaries(front, missing):
    """Passed on as None, the boundaries would turn the call into dense attention."""
    _, exports, recorder, _ = front
    args = markers(*VARLEN_REQUIRED)
    args[missing] = None
    with pytest.raises(TypeError, match=f"attention_varlen needs {missing}, an int32 array .* got None"):
        exports.attention_varlen(*args.values())
    assert recorder.calls == []


def test_the_modes_split_attentions_keywords(front):
    """Every keyword of attention belongs to the dense call or to one of the two entry points:
    block_mask and block_size to neither of them, the rest to one or both."""
    attention, exports, _, _ = front
    varlen_lacks = set(other_modes_keywords(exports.attention_varlen, VARLEN_REQUIRED, attention))
    kvcache_lacks = set(other_modes_keywords(exports.attention_with_kvcache, KVCACHE_REQUIRED, attention))
    assert varlen_lacks & kvcache_lacks == {"block_mask", "block_size"}
    assert {"page_table", "seqlens_k", "num_splits"} <= varlen_lacks
    assert {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"} <= kvcache_lacks


@pytest.mark.parametrize("name", FRONT_ENDS)
def test_exported_and_named_in_attentions_docstring(name):
    owner, exports, prefix = front_end(name)
    for entry in ENTRY_NAMES.values():
        assert entry in exports.__all__ and getattr(exports, entry).__doc__
        assert f":func:`{prefix}.{entry}`" in owner.attention.__doc__
