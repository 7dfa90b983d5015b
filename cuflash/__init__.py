"""cuflash: exact FlashAttention for Python, CUDA kernels compiled at run time by CuPy.

    o, l, m = cuflash.attention(q, k, v, causal=False, scale=None)

Importing cuflash needs neither a GPU nor CuPy's CUDA libraries; they load on first call.
"""

from . import reference
from ._api import AttentionOutput, attention

__all__ = ["attention", "AttentionOutput", "reference"]
__version__ = "0.1.0"
