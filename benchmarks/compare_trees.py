"""Tokens and accept lengths of every engine method × drafter kind on tiny random models (dense and hybrid,
T = 0 and T = 1, eager engine), as JSON: run it on two code trees and diff the outputs to show a refactor
changed no generated token and no accept length.

    PYTHONPATH=<tree>/src python benchmarks/compare_trees.py <tree> > out.json      # once per tree
    python benchmarks/compare_trees.py --diff a.json b.json
"""
import json
import sys

import torch

if sys.argv[1] == "--diff":
    a, b = (json.load(open(p)) for p in sys.argv[2:4])
    a.pop("src"), b.pop("src")
    keys = sorted(a)
    print(f"{len(keys)} configs; tokens equal {sum(a[k][0] == b[k][0] for k in keys)}; "
          f"accept lengths equal {sum(a[k][1] == b[k][1] for k in keys)}")
    for k in keys:
        if a[k] != b[k]:
            print("differs:", k)
    sys.exit(0)
sys.path.insert(0, sys.argv[1] + "/tests")
torch.set_num_threads(1)
import draftforge  # noqa: E402
from draftforge.engine import generate, make_method  # noqa: E402
from engine_fixtures import prompt, tiny_drafter, tiny_dspark_drafter, tiny_hybrid_target, tiny_target  # noqa: E402

out = {"src": draftforge.__file__}
for arch in ("Qwen3ForCausalLM", "Qwen3_5ForCausalLM"):
    tm = (tiny_hybrid_target if arch.startswith("Qwen3_5") else tiny_target)(arch, vocab=16, seed=3)
    kinds = {"dflash": tiny_drafter(tm, seed=3), "dspark": tiny_dspark_drafter(tm, seed=3),
             "dspark_ba": tiny_dspark_drafter(tm, seed=3, bonus_anchor=True)}
    for kind, d in kinds.items():
        methods = [("dflash", None), ("ddtree", 1), ("ddtree", 16)] + ([("dspark", None), ("ddtree_markov", 16)] if kind != "dflash" else [])
        for name, b in methods:
            for seed, plen in ((0, 9), (1, 70)):
                p = prompt(tm.vocab_size, plen, seed=seed)
                for T in (0.0, 1.0):
                    g = torch.Generator().manual_seed(7) if T > 0 else None
                    r = generate(tm, make_method(name, tm, d, b), p, 24, temperature=T, generator=g)
                    out[f"{arch}/{kind}/{name}/{b}/{seed}/{T}"] = [r.tokens, r.accept_lengths]
print(json.dumps(out))
