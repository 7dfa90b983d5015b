"""cuflash: exact FlashAttention for Python, CUDA kernels compiled at run time by CuPy.

    o, l, m = cuflash.attention(q, k, v, causal=False, scale=None)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, l, m, causal=False)
    o, l, m = cuflash.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))
    o, l, m = cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, l, m = cuflash.attention_with_kvcache(q, k_cache, v_cache, page_table=pages, seqlens_k=lengths)
    o, l, m = cuflash.merge(o_a, l_a, m_a, o_b, l_b, m_b)   # attention over two key sets, combined

Importing cuflash needs neither a GPU nor CuPy; they load on first call. Without CuPy, a call
that launches kernels raises ModuleNotFoundError naming the pip extra that installs it.
"""

from . import _requirements, masks
from ._api import AttentionGradients, AttentionOutput, attention, attention_backward
from ._entry_points import attention_varlen, attention_with_kvcache
from ._merge import merge, merge_stacked

if not _requirements.installed("cupy"):
    # Only then: with CuPy present the public functions stay the plain ones, free of the check.
    # merge needs no CuPy (it takes NumPy arrays too).
    attention = _requirements.needs_cupy(attention)
    attention_backward = _requirements.needs_cupy(attention_backward)
    attention_varlen = _requirements.needs_cupy(attention_varlen)
    attention_with_kvcache = _requirements.needs_cupy(attention_with_kvcache)

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "attention_backward", "merge", "merge_stacked",
           "AttentionOutput", "AttentionGradients", "masks", "reference"]
__version__ = "0.1.0"


def __getattr__(name):
    # cuflash.torch and cuflash.jax import their framework, and the float64 reference is the
    # tests' oracle, not part of a call: they load on first use only.
    if name in ("torch", "jax", "reference"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
