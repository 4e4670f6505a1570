"""Parity (docs/architecture.md, "The stage table"): vLLM-DFlash τ with OUR trained drafter vs our standalone DFlash τ, same prompt, T=0.

A drafter is overfit on the first evaluation prompt's greedy continuation (train loop of the train
stage), exported in vLLM's dflash layout, and decoded by both engines: our engine
(draftforge.engine.generate_dflash) writes an evaluate-style row, the baselines stage runs vLLM and
must report both τ side by side within 5 %. A train/serve mismatch (tap offset, LM head not shared)
collapses vLLM's τ to ~1 and fails this test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from drafter_fixtures import drafter_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.baselines.stage import main as baselines_main  # noqa: E402
from draftforge.cli import run_stage  # noqa: E402
from draftforge.io import write_json  # noqa: E402
from draftforge.report.parity import parity_block  # noqa: E402
from draftforge.report.rows import collect_rows  # noqa: E402
from train_fixtures import load_target, make_inputs, tapped_features  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
if __import__("importlib.util").util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed", allow_module_level=True)

EXP = "smoke"
N_GEN = 48


def _first_prompt_ids(info: dict) -> list[int]:
    """Exactly what the stage sends: evaluate's first humaneval prompt through the chat template."""
    from omegaconf import OmegaConf

    from draftforge.baselines.prompts import load_sets, render_sets
    from draftforge.chat import ChatMode
    from draftforge.config import compose
    from draftforge.target.load import load_tokenizer

    cfg = compose(EXP)
    sets = load_sets(OmegaConf.create({"evaluate": OmegaConf.to_container(cfg.evaluate)}), ["humaneval"], 1)
    return render_sets(load_tokenizer(info), sets, ChatMode())["humaneval"][0]["token_ids"]


def _overfit(info: dict, prompt: list[int], work: Path):
    from draftforge.train.config import TrainConfig
    from draftforge.train.loop import train

    target = load_target(info)
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=N_GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    cont = out[0, len(prompt):].tolist()
    ids = torch.tensor(prompt + cont)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[len(prompt) - 1 :] = 1  # the last prompt token is the first anchor both engines draft from
    item = (ids, mask, tapped_features(target, ids, info["drafter"]["target_layer_ids"]))
    cfg = TrainConfig(max_steps=300, batch_seqs=1, num_anchors=1024, lr=3e-3, warmup_ratio=0.05, eval_every=100,
                      ckpt_every=1000, log_every=50, val_num_anchors=1024, init_from_target=False, seed=0)  # fmt: skip
    return train(make_inputs(info, cfg, [item], [item], work / "ckpt")), cont, target


def test_vllm_dflash_tau_matches_standalone(tiny_target_info, tmp_path):
    from draftforge.drafter.export import export_drafter, load_drafter
    from draftforge.engine import generate_dflash, wrap_target

    info = tiny_target_info
    B = drafter_of().block_size
    root = tmp_path / "results"
    write_json(root / EXP / "target" / "target.json", info)
    prompt = _first_prompt_ids(info)
    result, cont, target = _overfit(info, prompt, tmp_path)
    drafter_dir = export_drafter(result.model, result.model.cfg, tmp_path / "drafter", dtype=torch.float32)

    # Our engine on the same prompt; stop B tokens early so every block lies in the memorized text.
    n_new = N_GEN - B
    ours = generate_dflash(wrap_target(target, info["drafter"]["target_layer_ids"]), load_drafter(drafter_dir), prompt, n_new)
    assert ours.tokens == cont[:n_new]
    evaluate_json = root / EXP / "evaluate" / "dflash" / "evaluate.json"
    write_json(evaluate_json, {"engine": "draftforge", "rows": [
        {"dataset": "humaneval", "method": "dflash", "budget": None, "engine": "draftforge", "temperature": 0.0,
         "tau": ours.tau, "n_prompts": 1}]})  # fmt: skip

    run_stage("baselines", baselines_main, [
        f"experiment={EXP}", f"results_root={root}", "target=tiny-random", "tracking.enabled=false",
        "baselines.datasets=[humaneval]", "baselines.num_prompts=1", f"baselines.max_new_tokens={n_new}",
        "baselines.ignore_eos=true", "baselines.kv_cache_gib=0.0625", "baselines.methods.ngram.enabled=false",
        f"baselines.methods.dflash.model={drafter_dir}"])  # fmt: skip
    marker = json.loads((root / EXP / "baselines" / "dflash" / "baselines.json").read_text())
    rows = {r["method"]: r for r in marker["rows"]}
    assert rows["dflash"]["status"] == "ok" and rows["dflash"]["lossless_mismatches"] == 0
    dflash = json.loads((root / EXP / "baselines" / "dflash" / "dflash.json").read_text())
    assert dflash["segments"][0]["prompts"][0]["token_ids"] == cont[:n_new]
    block = parity_block(collect_rows([evaluate_json], [root / EXP / "baselines" / "dflash" / "baselines.json"]), 0.05)
    parity = block["datasets"]["humaneval"]
    print("parity:", parity)
    assert parity["standalone_tau"] == pytest.approx(ours.tau) and parity["vllm_tau"] == pytest.approx(rows["dflash"]["tau"])
    assert ours.tau > B / 2, f"drafter not memorized under our engine (τ {ours.tau})"
    assert parity["within_tolerance"] is True and block["all_within"] is True, parity
