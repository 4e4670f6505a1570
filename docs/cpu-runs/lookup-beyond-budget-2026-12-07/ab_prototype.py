# A/B prototype run at 6458b81 (before the change): `ddtree_lookup` as it was (lookup nodes inside the budget)
# against `ddtree_lookup_x` (DDTree's budget + the lookup path on top while q^i >= THETA, at most 8; q counted on
# offered tokens only). Run from the repo root: python <this file> <dataset> 0.1 6

import sys, math, torch
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main/benchmarks")
from draftforge.chat import ChatMode
from draftforge.config import compose
from draftforge.drafter import load_drafter
from draftforge.engine import wrap_target
from draftforge.engine.methods import METHODS
from draftforge.engine.lookup import DDTreeLookup
from draftforge.engine.tree import Tree
from draftforge.evaluate.aggregate import aggregate
from draftforge.evaluate.prompts import eval_prompt_sets
from draftforge.evaluate.runner import EngineSet, run_dataset
from draftforge.paths import stage_dir, stage_marker
from draftforge.target.load import load_target_model, load_tokenizer, read_target_info

THETA = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
LMAX = 8
def union(tree, chain, lq):
    tokens, parents, depths, scores = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores)
    child = tree.children(); node = 0
    for i, tok in enumerate(chain, 1):
        nxt = child.get((node, tok))
        if nxt is None:
            nxt = len(tokens); tokens.append(tok); parents.append(node); depths.append(i); scores.append(i*lq)
            child[(node, tok)] = nxt
        node = nxt
    return Tree(tokens, parents, depths, scores)

class X(DDTreeLookup):
    name = "ddtree_lookup_x"
    def __init__(s, tm, d, b=None):
        super().__init__(tm, d, b); s.verify_size = 1 + s.budget + LMAX
    def build(s, drafted, bonus):
        tree = super(DDTreeLookup, s).build(drafted, bonus)
        q = (s.accepted + 1) / (s.tried + 2)
        k = min(LMAX, int(math.log(THETA) / math.log(q)))
        chain = s.index.continuation(k, after=[bonus]) if k > 0 else []
        s.offered = list(chain)
        return union(tree, chain, math.log(q)) if chain else tree
METHODS["ddtree_lookup_x"] = X

ds = sys.argv[1]
cfg = compose("default", ["results_root=/work/exp5/results"])
info = read_target_info(stage_marker(cfg.results_root, cfg.experiment_name, "target"))
drafter = load_drafter(stage_dir(cfg.results_root, cfg.experiment_name, "train", "dflash_aw_b4") / "drafter", dtype=torch.float32, attn_impl="sdpa")
tm = wrap_target(load_target_model(info), drafter.cfg.target_layer_ids)
es = EngineSet(tm, drafter, load_tokenizer(info), [int(e) for e in info.get("eos_token_ids") or []], 64, chat_mode=ChatMode.of(cfg))
plan = [("ar", None), ("ddtree", 4), ("ddtree_lookup", 3), ("ddtree_lookup", 4), ("ddtree_lookup", 8), ("ddtree_lookup_x", 3), ("ddtree_lookup_x", 4)]
ev = cfg.evaluate; ev.datasets = [ds]
prompts = eval_prompt_sets(ev, limit=int(sys.argv[3]) if len(sys.argv) > 3 else 6)[ds]
records = run_dataset(es, plan, ds, list(enumerate(prompts)), 0.0, 0, warmup=1, show=False)
rows = aggregate(records)
for r in rows:
    print(f"{ds} {r['method']:16} {str(r['budget'] or ''):>3} tok/s {r['tokens_per_s']:5.1f} speedup {r['speedup_vs_ar']:.2f} tau {r['tau']:.2f} round {r['round_ms']:.1f} mism {r['lossless_mismatches']}", flush=True)
