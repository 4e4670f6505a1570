import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load
torch.set_num_threads(2)
t0 = time.time()
m = load(name="df_attn_test", sources=[str(Path(__file__).parent / "decode_attention.cpp")], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
print("build", time.time() - t0)
def t(f, r=300):
    for _ in range(20): f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(r): f()
        best = min(best, (time.perf_counter() - t0) / r * 1e6)
    return round(best, 1)
hkv, g, hd, cap = 3, 3, 64, 2048
kv = torch.randn(2, hkv, cap, hd)
for n, L in ((1, 257), (4, 300), (13, 300), (17, 700), (1, 3)):
    q = torch.randn(1, hkv, g * n, hd)
    mask = torch.zeros(g * n, L)
    if n > 1:
        mask[:, -n:] = float("-inf"); mask[:, -n:].fill_diagonal_(0) if False else None
        for r in range(g * n): mask[r, L - n + (r % n)] = 0.0
    kc, vc = kv[0, :, :L][None], kv[1, :, :L][None]
    ref = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask[None, None] if n > 1 else None, scale=0.125)
    out = m.decode_attention(q[0], kv[0], kv[1], mask if n > 1 else None, L, 0.125)
    err = (out - ref[0]).abs().max().item()
    ts = t(lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask[None, None] if n > 1 else None, scale=0.125))
    tk = t(lambda: m.decode_attention(q[0], kv[0], kv[1], mask if n > 1 else None, L, 0.125))
    print(f"n={n} L={L}: sdpa {ts} us kernel {tk} us maxerr {err:.2e}")
