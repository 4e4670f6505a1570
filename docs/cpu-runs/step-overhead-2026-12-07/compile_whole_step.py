import sys, time, os, torch
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "src")); sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_roofline import build, verify_probe, timed
from draftforge.engine import cpu_linear, target as tgt
torch.set_num_threads(2)

@torch.library.custom_op("dfexp::linear", mutates_args=())
def routed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return orig(x, w, b)
@routed.register_fake
def _(x, w, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])
orig = cpu_linear.linear
def linear(x, w, bias=None):
    if torch.compiler.is_compiling():
        return routed(x, w, bias)
    return orig(x, w, bias)
cpu_linear.linear = linear

tm, d = build(False)
prompt = list(range(5, 261))
cpu_linear.pretune([1, 2, 3, 4, 5, 17])
one = verify_probe(tm, prompt, 1)
eager_rl = tgt.run_layers
import torch._dynamo
torch._dynamo.config.cache_size_limit = 64
comp_rl = torch.compile(eager_rl, dynamic=True)
ar_e = timed(one, 10, 2)
tgt.run_layers = comp_rl
t0 = time.time(); one(); print(f"first compiled call {time.time()-t0:.1f}s", flush=True)
t0 = time.time(); one(); print(f"second compiled call {time.time()-t0:.1f}s", flush=True)
e, c = [], []
for _ in range(5):
    tgt.run_layers = eager_rl; e.append(timed(one, 5, 1))
    tgt.run_layers = comp_rl; c.append(timed(one, 5, 1))
print(f"AR eager {ar_e*1e3:.1f}; alternating min eager {min(e)*1e3:.1f} compiled {min(c)*1e3:.1f}", flush=True)
for n in (4, 17):
    o2 = verify_probe(tm, prompt, n)
    t0 = time.time(); o2(); print(f"n={n} first call {time.time()-t0:.1f}s", flush=True)
    tgt.run_layers = eager_rl; te = timed(o2, 5, 1)
    tgt.run_layers = comp_rl; tc = timed(o2, 5, 1)
    print(f"verify {n}: eager {te*1e3:.1f} compiled {tc*1e3:.1f}", flush=True)
