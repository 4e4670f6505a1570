"""Usage: python rescore_draft_vocab.py 8192,16384,0 <run>/results

Served τ_sim of one trained drafter with its draft vocabulary widened (the head = the target's LM-head rows)."""
import dataclasses, json, sys, time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
import torch
sys.path.insert(0, str(REPO / "benchmarks")); sys.path.insert(0, str(REPO / "src"))
import score_responses as sr
from draftforge import chat
from draftforge.config import compose
from draftforge.drafter.export import load_drafter
from draftforge.drafter.vocab import choose_draft_vocab
from draftforge.evaluate.prompts import eval_and_calibration_sets
from draftforge.target.load import load_target_model, load_tokenizer, read_target_info
from draftforge.paths import stage_marker
from draftforge.train.config import TrainConfig
from draftforge.train.features import open_features
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs, evaluate
from draftforge.train.online import OnlineTarget
torch.set_num_threads(2)
res, expn, drafter = Path(sys.argv[2]), "default", "dflash_aw_b4"  # argv[2]: a whole default run's results/
exp = res / expn
info = json.loads((exp / "target" / "target.json").read_text())
cfg = compose(expn, [f"results_root={res}", f"drafter={drafter}"])
base = load_drafter(exp / "train" / drafter / "drafter", dtype=torch.float32)
hf = load_target_model(info, dtype=torch.float32)
hf.set_attn_implementation("eager")
target = OnlineTarget(hf, list(info["drafter"]["target_layer_ids"]), torch.device("cpu"), torch.float32, last=True)
tok, mode = load_tokenizer(info), chat.ChatMode.of(cfg)
head = FrozenTargetHead.from_target(info["hf_path"], dtype=torch.float32)
tcfg = dataclasses.replace(TrainConfig(), val_max_seqs=1_000_000, val_num_anchors=1024, max_seq_len=4096)
sets, _ = eval_and_calibration_sets(cfg.evaluate)
tr, _ = open_features(exp / "extract", read_target_info(stage_marker(str(res), expn, "target")))
counts = tr.label_counts(base.cfg.vocab_size)
lm = hf.lm_head.weight.detach().float()
def variant(D):
    if D == base.cfg.draft_vocab_size:
        return base
    m = type(base)(dataclasses.replace(base.cfg, draft_vocab_size=D))
    sd = {k: v for k, v in base.state_dict().items() if k not in ("draft_ids", "draft_head")}
    m.load_state_dict(sd, strict=False)
    if D:
        m.set_draft_vocab(choose_draft_vocab(counts, D), lm)
    return m.eval()
items = {}
for dataset, prompts in sets.items():
    payload = json.loads((exp / "evaluate" / drafter / f"{dataset}.json").read_text())
    items[dataset] = sr.served_items(payload["responses"], prompts, tok, mode, target)
Ds = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8192, 16384, 0]
out = {}
for D in Ds:
    m = variant(D)
    for dataset, it in items.items():
        inp = TrainInputs(cfg=tcfg, dcfg=m.cfg, train_source=it, val_source=it, head=head, ckpt_dir=Path("."),
                          resume_key="", acceptance_weighting=bool(cfg.drafter.acceptance_weighting))
        t0 = time.time()
        r = evaluate(m, inp, torch.float32)
        out[(D, dataset)] = r["val_sim_tau"]
        print(D, dataset, round(r["val_sim_tau"], 3), f"{time.time()-t0:.0f}s", flush=True)
