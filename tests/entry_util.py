"""For the tests of the entry points of one mode each (attention_varlen, attention_with_kvcache)
in every front end: a stand-in for the front end's attention that records how it is called,
and the signature rules the entry points share."""

import inspect

import pytest

VARLEN_REQUIRED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
KVCACHE_REQUIRED = ("q", "k_cache", "v_cache")


class Recorder:
    """Stands in for a front end's ``attention``: records each call's positional and keyword
    arguments and returns a marker object, so a test sees exactly what an entry point passed
    on and that it hands the result back untouched."""

    def __init__(self):
        self.calls = []
        self.result = object()

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


class Marker:
    """An argument that only its identity can equal: what an entry point must pass on as given."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


def markers(*names) -> dict:
    return {name: Marker(name) for name in names}


def other_modes_keywords(entry, required, attention) -> list:
    """Checks that ``entry`` takes ``required`` positionally, in that order and without
    defaults, then keyword-only arguments with defaults, every one of them (the three arrays
    aside) a keyword of ``attention``; returns attention's keywords that ``entry`` lacks: those
    of the other modes, which its signature must refuse."""
    params = inspect.signature(entry).parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == list(required)
    assert all(p.default is inspect.Parameter.empty for p in params if p.name in required)
    rest = [p for p in params if p.name not in required]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
               for p in rest), rest
    theirs = set(inspect.signature(attention).parameters) - {"q", "k", "v"}
    ours = {p.name for p in params} - set(required[:3])
    assert ours <= theirs, sorted(ours - theirs)
    return sorted(theirs - ours)


def check_refuses_other_modes(entry, required, attention, recorder, args):
    """Every keyword of another mode, given to ``entry`` (called with ``args``), is a TypeError
    naming it, and nothing reaches ``recorder``."""
    others = other_modes_keywords(entry, required, attention)
    assert others, "attention has keywords of other modes"
    for name in others:
        with pytest.raises(TypeError, match=name):
            entry(*args, **{name: None})
    assert recorder.calls == []


def check_passes_on(entry, required, recorder, defaults, **given):
    """``entry`` called with a marker for each required argument and with ``given`` makes one
    call of attention and returns its result untouched: the three arrays positionally, the rest
    of ``required`` and every keyword as keywords, those not given at their ``defaults``, which
    must name every keyword ``entry`` takes."""
    keywords = [p.name for p in inspect.signature(entry).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert sorted(keywords) == sorted(defaults)
    args = markers(*required)
    assert entry(*args.values(), **given) is recorder.result
    assert recorder.calls == [(tuple(args.values())[:3], {**defaults, **dict(list(args.items())[3:]), **given})]


def paged_problem(rng, dtype, vllm=False):
    """For the GPU tests: 2 queries a head (32 query heads on 8 k/v heads, d 128) of sequences
    of 0, 1, 100 and 1000 keys. Returns the host q, k, v (k and v logical, (batch, Hk, 1024,
    d)), the lengths, and the test_decode_gpu.PagedCache holding k and v in shuffled 64-key
    pages (``vllm``: its device cache in vLLM's layout)."""
    from test_decode_gpu import PagedCache, inputs

    lengths = [0, 1, 100, 1000]
    q, k, v = inputs(rng, dtype, len(lengths), (32, 8), 2, 1024, 128)
    return q, k, v, lengths, PagedCache(rng, k, v, lengths, page_size=64, vllm=vllm)
