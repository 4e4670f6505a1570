import sys, torch
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "src")); sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_roofline import build, verify_probe, timed
from cpu_step_overhead import StubbedProducts
from draftforge.engine import cpu_linear
tm, d = build(False)
prompt = list(range(5, 261))
cpu_linear.pretune([1, 4, 13])
for n in (1, 4, 13):
    one = verify_probe(tm, prompt, n)
    res = {}
    for rep in range(6):
        for th in (2, 1):
            torch.set_num_threads(th)
            with StubbedProducts():
                res[th] = min(res.get(th, 1e9), timed(one, 5, 1))
    print(n, "stubbed ms by threads", {k: round(v * 1e3, 2) for k, v in res.items()}, flush=True)
