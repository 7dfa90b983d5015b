import numpy as np, cupy, cuflash
from cuflash import reference as ref, _api, _config
rng = np.random.default_rng(0)
for d, nq, nk, causal in [(8, 17, 17, False), (64, 113, 17, False), (64, 1, 1, False)]:
    q, k, v, do = (rng.standard_normal((2, 2, n, d)).astype(np.float32) for n in (nq, nk, nk, nq))
    qd, kd, vd, dod = map(cupy.asarray, (q, k, v, do))
    o, l, m = cuflash.attention(qd, kd, vd, causal=causal)
    g = cuflash.attention_backward(dod, qd, kd, vd, o, l, m, causal=causal)
    e = ref.standard_attention_backward(do, q, k, v, causal=causal)
    for name, a, b in zip("qkv", g, e):
        a = cupy.asnumpy(a)
        print(d, nq, nk, name, "maxerr", np.abs(a - b).max(), "max|ref|", np.abs(b).max(), "argmax", np.unravel_index(np.abs(a-b).argmax(), a.shape))
    print(" o err", np.abs(cupy.asnumpy(o) - ref.standard_attention(q, k, v, causal=causal).o).max())
