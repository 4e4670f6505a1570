import sys, time, torch, torch.nn.functional as F
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "src")); sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_roofline import build, verify_probe, timed
from cpu_step_overhead import StubbedProducts
from draftforge.engine import cpu_linear, target as tgt, blocks
from draftforge.engine.blocks import attend
torch.set_num_threads(2)

@torch.library.custom_op("dfexp::linear", mutates_args=())
def routed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_linear.linear(x, w)
@routed.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])

def pre(h, nw, wqkv, cos, sin, eps: float, hq: int, hkv: int, hd: int):
    n = h.shape[1]
    x = F.rms_norm(h, (h.shape[-1],), nw, eps)
    qkv = routed(x, wqkv).view(1, n, hq + 2 * hkv, hd).transpose(1, 2)
    qk = qkv[:, : hq + hkv]
    half = hd // 2
    rot = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = qk * cos + rot * sin
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]

def post(h, o, wo, nw, wgu, wd, eps: float):
    n = h.shape[1]
    h = h + routed(o.transpose(1, 2).reshape(1, n, -1), wo)
    x = F.rms_norm(h, (h.shape[-1],), nw, eps)
    g, u = routed(x, wgu).chunk(2, dim=-1)
    return h + routed(F.silu(g) * u, wd)

cpre = torch.compile(pre, dynamic=True, fullgraph=True)
cpost = torch.compile(post, dynamic=True, fullgraph=True)

def run_layers_c(tm, state, step, rt, want_taps):
    n = step.ids.shape[1]
    cos, sin = tgt.rope_tables(tm, step.positions)
    h = tm.embed(step.ids)
    taps = []
    for i, layer in enumerate(tm.layers):
        s, fl = tm.slots[i], rt.fused[i]
        attn = layer.self_attn
        q, k, v = cpre(h, layer.input_layernorm.weight, fl.wqkv, cos, sin, layer.input_layernorm.variance_epsilon, tm.num_heads, tm.num_kv_heads, tm.head_dim)
        kv = state.kv[s]
        kv[0].index_copy_(1, step.slots, k[0])
        kv[1].index_copy_(1, step.slots, v[0])
        kc, vc = kv[0, :, : step.kv_len][None], kv[1, :, : step.kv_len][None]
        o = attend(q, kc, vc, step.mask, step.causal, attn.scaling)
        h = cpost(h, o, attn.o_proj.weight, layer.post_attention_layernorm.weight, fl.wgu, layer.mlp.down_proj.weight, layer.post_attention_layernorm.variance_epsilon)
        if want_taps and i in tm._tap_pos:
            taps.append(h)
    return tm.norm(h), (torch.cat(taps, dim=-1) if taps else None)

tm, d = build(False)
prompt = list(range(5, 261))
cpu_linear.pretune([1, 2, 3, 4, 5, 13])
eager_rl = tgt.run_layers
for n in (1, 13):
    one = verify_probe(tm, prompt, n)
    tgt.run_layers = run_layers_c
    t0 = time.time(); one(); print(f"n={n} first compiled call {time.time()-t0:.1f}s", flush=True)
    res = {}
    for rep in range(6):
        for name, f in (("eager", eager_rl), ("compiled", run_layers_c)):
            tgt.run_layers = f
            res[name] = min(res.get(name, 1e9), timed(one, 5, 1))
            with StubbedProducts():
                res[name + "_stub"] = min(res.get(name + "_stub", 1e9), timed(one, 5, 1))
    print(n, {k: round(v * 1e3, 2) for k, v in res.items()}, flush=True)
# check equality of outputs
tgt.run_layers = eager_rl
