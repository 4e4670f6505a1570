import sys, time, os, torch
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "src")); sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_roofline import build, verify_probe, timed
from draftforge.engine import cpu_linear, fused, target as tgt
import torch.nn.functional as F
torch.set_num_threads(2)

@torch.library.custom_op("dfexp::linear", mutates_args=())
def routed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return cpu_linear.linear(x, w, b)
@routed.register_fake
def _(x, w, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])

orig = cpu_linear.linear
def linear(x, w, bias=None):
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32:
        return routed(x, w, bias)
    return orig(x, w, bias)
cpu_linear.linear = linear

tm, d = build(False)
prompt = list(range(5, 261))
cpu_linear.pretune([1, 2, 3, 4, 5])
one = verify_probe(tm, prompt, 1)
ar_eager = timed(one, 15, 3)
mode = sys.argv[1] if len(sys.argv) > 1 else "dyn"
import torch._dynamo, torch._inductor.config
torch._dynamo.config.cache_size_limit = 64
kw = {"dynamic": mode == "dyn", "fullgraph": True}
plain = fused.plain_blocks()
cb = fused.LayerBlocks(**{f: torch.compile(getattr(plain, f), **kw) if f in ("qkv", "post", "mlp") else getattr(plain, f)
                          for f in ("qkv", "post", "split", "mlp", "draft_qkv", "draft_out")})
tm.runtime.blocks = cb
t0 = time.time(); one(); print(f"first compiled call {time.time()-t0:.1f}s")
ar_c = timed(one, 15, 3)
# alternate
e, c = [], []
for _ in range(5):
    tm.runtime.blocks = plain; e.append(timed(one, 5, 1))
    tm.runtime.blocks = cb; c.append(timed(one, 5, 1))
print(f"AR eager {ar_eager*1e3:.1f} compiled {ar_c*1e3:.1f}; alternating min eager {min(e)*1e3:.1f} compiled {min(c)*1e3:.1f}")
for n in (4, 17):
    o2 = verify_probe(tm, prompt, n)
    t0 = time.time(); o2(); print(f"n={n} first call {time.time()-t0:.1f}s")
    tm.runtime.blocks = plain; te = timed(o2, 5, 1)
    tm.runtime.blocks = cb; tc = timed(o2, 5, 1)
    print(f"verify {n}: eager {te*1e3:.1f} compiled {tc*1e3:.1f}")
cnt = {"reg": 0, "unreg": 0}
def routed_impl_check(x, w, b):
    cnt["reg" if getattr(w, "_draftforge_registered", False) else "unreg"] += 1
    return orig(x, w, b)
import draftforge.engine.cpu_linear as cl
cl_linear_saved = cl.linear
cl.linear = lambda x, w, bias=None: (routed(x, w, bias) if torch.compiler.is_compiling() else cl_linear_saved(x, w, bias))
# patch the op's eager impl via global used inside routed
routed._opoverload  # noqa
tm.runtime.blocks = cb
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(5):
        one()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
