import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "src"))
from draftforge.engine import cpu_kernel
torch.set_num_threads(2)
cpu_kernel.available()
big = torch.empty(128 << 20 >> 2).uniform_()  # 128 MiB
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536), "lm": (49152, 576)}
groups = {k: [torch.randn(*s) for _ in range(max(1, (96 << 20) // (s[0] * s[1] * 4)))] for k, s in shapes.items()}
def bw_sum():
    t0 = time.perf_counter(); big.sum(); return big.numel() * 4 / (time.perf_counter() - t0)
def bw_kernel(ws, rows=1):
    x = torch.randn(rows, ws[0].shape[1])
    t0 = time.perf_counter()
    for w in ws: cpu_kernel.skinny_linear(x, w, None)
    return sum(w.numel() * 4 for w in ws) / (time.perf_counter() - t0)
res = {k: 0 for k in ["sum", *shapes]}
for rep in range(7):
    res["sum"] = max(res["sum"], bw_sum())
    for k, ws in groups.items():
        res[k] = max(res[k], bw_kernel(ws))
print({k: round(v / 1e9, 1) for k, v in res.items()})
torch.set_num_threads(1)
res1 = {k: 0 for k in ["sum", *shapes]}
for rep in range(5):
    res1["sum"] = max(res1["sum"], bw_sum())
    for k, ws in groups.items():
        res1[k] = max(res1[k], bw_kernel(ws))
print("1 thread", {k: round(v / 1e9, 1) for k, v in res1.items()})
