"""baselines: counter arithmetic, rows/speedup/lossless, the parity check, method specs (no engine needed)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baselines_fixtures import export_random_drafter, plain_cfg  # noqa: E402
from draftforge.baselines import metrics as M  # noqa: E402
from draftforge.baselines.rows import add_comparisons, method_rows  # noqa: E402
from draftforge.baselines.spec import plan_method, resolve_settings, worker_spec  # noqa: E402
from draftforge.errors import StageError  # noqa: E402
from draftforge.report.parity import parity_block  # noqa: E402


# Same shapes as vllm.v1.metrics.reader's dataclasses (matched by class name / attributes).
@dataclass
class Counter:
    name: str
    labels: dict
    value: int


@dataclass
class Vector:
    name: str
    labels: dict
    values: list


@dataclass
class Gauge:
    name: str
    labels: dict
    value: float


def snap(drafts, draft_tokens, accepted, per_pos, gen):
    return M.snapshot([
        Counter(M.DRAFTS, {"engine": "0"}, drafts),
        Counter(M.DRAFT_TOKENS, {"engine": "0"}, draft_tokens),
        Counter(M.ACCEPTED, {"engine": "0"}, accepted),
        Vector(M.ACCEPTED_PER_POS, {"engine": "0"}, per_pos),
        Counter(M.GENERATION_TOKENS, {"engine": "0"}, gen),
        Gauge("vllm:num_requests_running", {"engine": "0"}, 0.0),
    ])  # fmt: skip


def test_snapshot_sums_label_sets_and_skips_gauges():
    s = M.snapshot([Counter(M.DRAFTS, {"engine": "0"}, 3), Counter(M.DRAFTS, {"engine": "1"}, 4),
                    Vector(M.ACCEPTED_PER_POS, {"engine": "0"}, [2, 1]), Vector(M.ACCEPTED_PER_POS, {"engine": "1"}, [1, 1, 1]),
                    Gauge("vllm:kv_cache_usage_perc", {}, 0.5)])  # fmt: skip
    assert s == {"counters": {M.DRAFTS: 7}, "vectors": {M.ACCEPTED_PER_POS: [3, 2, 1]}}


def test_tau_from_counter_deltas_excludes_warmup():
    before = snap(5, 20, 9, [4, 3, 2, 0], 40)  # warm-up traffic: must not count
    after = snap(15, 60, 29, [12, 9, 6, 2], 100)
    acc = M.acceptance(M.delta(before, after))
    assert acc["num_drafts"] == 10 and acc["num_accepted_tokens"] == 20
    assert acc["tau"] == pytest.approx(1 + 20 / 10)
    assert acc["acceptance_per_pos"] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert acc["draft_acceptance_rate"] == pytest.approx(20 / 40)
    assert M.check_consistency(acc) == []


def test_no_drafts_gives_undefined_tau_and_inconsistency_is_reported():
    acc = M.acceptance(M.delta(snap(0, 0, 0, [], 0), snap(0, 0, 0, [], 50)))
    assert acc["tau"] is None and acc["acceptance_per_pos"] is None
    bad = M.acceptance(M.delta(snap(0, 0, 0, [0, 0], 0), snap(4, 8, 5, [1, 3], 20)))
    problems = M.check_consistency(bad)
    assert any("sum(accepted_per_pos)" in p for p in problems) and any("non-increasing" in p for p in problems)
    with pytest.raises(ValueError, match="decreased"):
        M.delta(snap(5, 5, 5, [5], 5), snap(4, 5, 5, [5], 5))


def test_timing_summary_excludes_prefill():
    prompts = [{"n_output": 11, "wall_s": 1.5, "ttft_s": 0.5, "decode_s": 1.0},
               {"n_output": 21, "wall_s": 2.5, "ttft_s": 0.3, "decode_s": 2.0}]  # fmt: skip
    t = M.timing_summary(prompts)
    assert t["tokens_per_s"] == pytest.approx(30 / 3.0)
    assert t["tpot_ms"] == pytest.approx(1000 * (0.1 + 0.1) / 2)
    assert t["ttft_ms"] == pytest.approx(400.0)
    assert t["wall_tokens_per_s"] == pytest.approx(32 / 4.0)


def _segment(dataset, prompts, before, after, temperature=0.0):
    return {"dataset": dataset, "temperature": temperature, "metrics_before": before, "metrics_after": after, "prompts": prompts}


def _prompt(pid, tokens, decode_s):
    return {"id": pid, "n_prompt": 5, "n_output": len(tokens), "token_ids": tokens, "wall_s": decode_s + 0.1, "ttft_s": 0.1, "decode_s": decode_s}  # fmt: skip


def test_rows_speedup_lossless_and_failed_method():
    plan = [{"dataset": "d", "temperature": 0.0}]
    ar = {"status": "ok", "segments": [_segment("d", [_prompt("d/0", [1, 2, 3, 4, 5], 0.4), _prompt("d/1", [6, 7, 8], 0.2)],
                                                 M.snapshot([]), M.snapshot([Counter(M.GENERATION_TOKENS, {}, 8)]))]}  # fmt: skip
    spec = {"status": "ok", "segments": [_segment("d", [_prompt("d/0", [1, 2, 3, 4, 5], 0.2), _prompt("d/1", [6, 7, 9], 0.1)],
                                                   snap(1, 4, 2, [1, 1, 0, 0], 3), snap(4, 16, 6, [3, 2, 1, 0], 11))]}  # fmt: skip
    failed = {"status": "failed", "reason": "worker exited with status -9 without a result"}
    results = {"ar": ar, "dflash": spec, "ngram": failed}
    rows = method_rows("ar", ar, plan, None) + method_rows("dflash", spec, plan, 4) + method_rows("ngram", failed, plan, 4)
    add_comparisons(rows, results)
    by = {r["method"]: r for r in rows}
    assert by["ar"]["tau"] == 1.0 and by["ar"]["speedup_vs_ar"] == pytest.approx(1.0) and by["ar"]["lossless_mismatches"] == 0
    assert by["dflash"]["tau"] == pytest.approx(1 + 4 / 3)
    assert by["dflash"]["speedup_vs_ar"] == pytest.approx(2.0)  # TPOT 0.1 s/token vs 0.05 s/token on both prompts
    assert by["dflash"]["lossless_mismatches"] == 1  # d/1 differs from AR
    assert by["dflash"]["acceptance_per_pos"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 0.0])
    assert by["dflash"]["tau_all_steps"] == pytest.approx(6 / (6 - 4))  # 8 tokens, 2 from prefill, 4 accepted
    assert by["ar"]["tau_all_steps"] == pytest.approx(1.0)
    assert by["ngram"]["status"] == "failed" and by["ngram"]["tau"] is None and by["ngram"]["tokens_per_s"] is None
    assert "without a result" in by["ngram"]["reason"]
    for row in rows:
        assert {"dataset", "method", "budget", "engine", "temperature", "tokens_per_s", "tpot_ms", "ttft_ms", "tau",
                "speedup_vs_ar", "lossless_mismatches", "n_prompts"} <= set(row)  # fmt: skip
        assert row["engine"] == "vllm"


def test_parity_block():
    vllm = [{"method": "dflash", "dataset": "humaneval", "engine": "vllm", "temperature": 0.0, "tau": 3.0, "n_prompts": 4},
            {"method": "dflash", "dataset": "chitchat", "engine": "vllm", "temperature": 0.0, "tau": 2.0, "n_prompts": 4}]  # fmt: skip
    missing = parity_block(vllm, 0.05)
    assert missing["available"] is False and "standalone" in missing["reason"]
    ours = [
        {"method": "dflash", "dataset": "humaneval", "engine": "draftforge", "temperature": 0.0, "tau": 2.95, "n_prompts": 4},
        {"method": "dflash", "dataset": "humaneval", "engine": "draftforge", "temperature": 1.0, "tau": 2.0, "n_prompts": 4},
        {"method": "ddtree", "dataset": "humaneval", "engine": "draftforge", "temperature": 0.0, "tau": 4.0, "budget": 64},
        {"method": "dflash", "dataset": "chitchat", "engine": "draftforge", "temperature": 0.0, "tau": 2.5}]  # fmt: skip
    block = parity_block(vllm + ours, 0.05)
    assert block["available"] is True and block["all_within"] is False
    assert block["datasets"]["humaneval"]["within_tolerance"] is True
    assert block["datasets"]["humaneval"]["rel_diff"] == pytest.approx(0.05 / 2.95)
    assert block["datasets"]["humaneval"]["standalone_n_prompts"] == 4
    assert block["datasets"]["chitchat"]["within_tolerance"] is False


INFO = {"name": "tiny", "hf_path": "/nonexistent", "num_layers": 4, "hidden_size": 128, "intermediate_size": 256,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096,
        "mtp_layers": 0, "dtype": "float32",
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 3, "target_layer_ids": [1, 2]}}  # fmt: skip


def test_method_specs(tmp_path):
    cfg = plain_cfg()
    assert plan_method("ar", cfg.methods.ar, INFO, None).speculative_config is None
    ngram = plan_method("ngram", cfg.methods.ngram, INFO, None).speculative_config
    assert ngram == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    mtp = plan_method("mtp", cfg.methods.mtp, INFO, None)
    assert mtp.speculative_config is None and "no MTP layers" in mtp.skip_reason
    assert plan_method("mtp", cfg.methods.mtp, {**INFO, "mtp_layers": 1}, None).speculative_config == {"method": "mtp", "num_speculative_tokens": 1}
    assert "EAGLE-3" in plan_method("eagle3", cfg.methods.eagle3, INFO, None).skip_reason

    drafter = export_random_drafter(INFO, tmp_path / "drafter")
    dflash = plan_method("dflash", cfg.methods.dflash, INFO, drafter)
    assert dflash.speculative_config == {"method": "dflash", "model": str(drafter.resolve()), "num_speculative_tokens": 7}
    with pytest.raises(StageError, match="4-layer target, target has 6"):
        plan_method("dflash", cfg.methods.dflash, {**INFO, "num_layers": 6}, drafter)
    with pytest.raises(StageError, match="not an exported drafter"):
        plan_method("dflash", cfg.methods.dflash, INFO, tmp_path / "nothing")
    with pytest.raises(StageError, match="unknown method"):
        plan_method("medusa", cfg.methods.ar, INFO, None)


def test_engine_settings_cpu_defaults_and_worker_spec():
    cfg = plain_cfg()
    s = resolve_settings(cfg, INFO, "cpu", longest_prompt=100, max_new_tokens=64)
    kw = s.llm_kwargs()
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True and kw["max_num_seqs"] == 1
    assert kw["enable_prefix_caching"] is False and kw["disable_log_stats"] is False
    assert kw["kv_cache_memory_bytes"] == int(0.5 * 2**30) and kw["max_model_len"] == 100 + 64 + 64
    assert kw["distributed_executor_backend"] == "uni" and kw["async_scheduling"] is False
    gpu = resolve_settings(plain_cfg(), {**INFO, "dtype": "bfloat16"}, "cuda", 100, 64)
    assert s.in_process_engine is True and gpu.in_process_engine is False
    assert gpu.dtype == "bfloat16" and gpu.enforce_eager is False and "distributed_executor_backend" not in gpu.llm_kwargs()
    assert "async_scheduling" not in gpu.llm_kwargs()  # vLLM's own default with its multi-process engine
    with pytest.raises(StageError, match="max_model_len"):
        resolve_settings(plain_cfg(max_model_len=100), INFO, "cpu", 100, 64)
    plan = plan_method("ngram", cfg.methods.ngram, INFO, None)
    spec = worker_spec(plan, INFO, s, [{"dataset": "d", "temperature": 0.0, "prompts": [{"id": "d/0", "token_ids": [1, 2]}]}], 64, cfg)
    json.dumps(spec)  # the worker receives JSON
    assert spec["speculative_config"]["method"] == "ngram" and spec["max_new_tokens"] == 64 and spec["ignore_eos"] is False


def test_prompts_rendered_with_chat_template(tiny_target_info):
    from draftforge.baselines.prompts import first_turn_only, render_sets
    from draftforge.chat import ChatMode
    from draftforge.target.load import load_tokenizer

    tok = load_tokenizer(tiny_target_info)
    sets = {"s": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]]}
    out = render_sets(tok, sets, ChatMode())
    ids = out["s"][0]["token_ids"]
    assert out["s"][0]["id"] == "s/0" and tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert first_turn_only(sets["s"][1]) == [{"role": "user", "content": "a"}]
    with pytest.raises(StageError, match="s/0"):
        render_sets(tok, {"s": [[{"role": "assistant", "content": "x"}]]}, ChatMode())


def test_mtp_spec_native_or_trained(tmp_path):
    """mtp: native layers → vLLM's own MTP; else the train stage's head in MiMo format as the draft model,
    with the target's config given one MTP layer; neither → a recorded skip saying so."""
    import json

    from draftforge.baselines.spec import worker_spec

    cfg = plain_cfg()
    native = plan_method("mtp", cfg.methods.mtp, {**INFO, "mtp_layers": 1}, None, trained_mtp_dir=tmp_path / "absent")
    assert native.source == "native" and native.llm_overrides is None
    skip = plan_method("mtp", cfg.methods.mtp, INFO, None, trained_mtp_dir=tmp_path / "absent")
    assert "no trained MTP head" in skip.skip_reason
    head = tmp_path / "mtp"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM"], "hidden_size": 128}))
    trained = plan_method("mtp", cfg.methods.mtp, INFO, None, trained_mtp_dir=head)
    assert trained.source == "trained" and trained.draft_model == str(head.resolve())
    assert trained.speculative_config == {"method": "mtp", "model": str(head.resolve()), "num_speculative_tokens": 3}
    settings = __import__("types").SimpleNamespace(llm_kwargs=lambda: {"dtype": "float32"})
    spec = worker_spec(trained, INFO, settings, [], 8, cfg)
    assert spec["llm_kwargs"] == {"dtype": "float32", "hf_overrides": {"num_nextn_predict_layers": 1}}
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128}))
    with pytest.raises(StageError, match="baselines.methods.mtp.model"):
        plan_method("mtp", cfg.methods.mtp, INFO, None, trained_mtp_dir=head)


def test_dspark_plan_skips_with_the_exact_reason(tmp_path):
    """A DFlash drafter → skip naming it; a DSpark drafter on CPU → vLLM's own refusal; on CUDA → the spec."""
    import torch

    from draftforge.baselines.spec import DSPARK_CPU_REASON
    from draftforge.drafter import DFlashConfig, DFlashDrafter
    from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter
    from draftforge.drafter.export import export_drafter

    cfg = plain_cfg()
    info = {**INFO, "num_layers": 4, "hidden_size": 64, "vocab_size": 300}
    base = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=300, mask_token_id=3, target_layer_ids=[0, 2], block_size=4, target_num_layers=4)
    export_drafter(DFlashDrafter(base), base, tmp_path / "dflash", dtype=torch.float32)
    dcfg = DSparkConfig.from_dflash(base, markov_rank=4)
    export_drafter(DSparkDrafter(dcfg), dcfg, tmp_path / "dspark", dtype=torch.float32)
    assert "DFlash drafter" in plan_method("dspark", cfg.methods.dspark, info, tmp_path / "dflash", device="cpu").skip_reason
    cpu = plan_method("dspark", cfg.methods.dspark, info, tmp_path / "dspark", device="cpu")
    assert cpu.skip_reason == DSPARK_CPU_REASON and "Model Runner V1 does not support: dspark" in cpu.skip_reason
    assert "DSpark drafter" in plan_method("dflash", cfg.methods.dflash, info, tmp_path / "dspark").skip_reason
    cuda = plan_method("dspark", cfg.methods.dspark, info, tmp_path / "dspark", device="cuda")
    assert cuda.skip_reason is None and cuda.speculative_config["num_speculative_tokens"] == 4  # every slot drafts
