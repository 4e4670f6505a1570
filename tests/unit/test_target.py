"""The `target` stage on tiny random models, and its clear errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftforge.config import compose
from draftforge.errors import StageError
from draftforge.target.inspect import fingerprint
from draftforge.target.load import load_target_model, load_tokenizer, read_target_info
from draftforge.target.stage import resolve_target

REPO = Path(__file__).resolve().parents[2]


def run_target_cli(results_root: Path, *overrides: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTFORGE_CACHE": str(results_root / "cache"), **(env_extra or {})}
    cmd = [sys.executable, "-m", "draftforge.target", "experiment=smoke", f"results_root={results_root}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_tiny_random_target_description(tiny_target_info: dict) -> None:
    info = tiny_target_info
    assert info["architecture"] == "LlamaForCausalLM" and info["num_layers"] == 4
    assert (info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (128, 4, 2, 32)
    assert info["vocab_size"] == 512 and info["chat_template"] and info["eos_token_ids"] == [2]
    assert info["drafter"]["target_layer_ids"] == [1, 2] and info["drafter"]["n_taps"] == 2
    assert info["mtp_layers"] == 0 and not info["hybrid_attention"]
    assert info["fingerprint"] == fingerprint(Path(info["hf_path"]))


def test_loaded_target_matches_its_description(tiny_target_info: dict) -> None:
    model = load_target_model(tiny_target_info)
    tokenizer = load_tokenizer(tiny_target_info)
    assert not any(p.requires_grad for p in model.parameters())
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"]
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tiny_target_info["vocab_size"])


def test_fingerprint_changes_with_weights(tmp_path: Path) -> None:
    cfg_a = compose("smoke", ["target=tiny-random"]).target
    cfg_b = compose("smoke", ["target=tiny-random", "target.random.seed=1"]).target
    a, b = resolve_target(cfg_a, tmp_path), resolve_target(cfg_b, tmp_path)
    assert a["hf_path"] != b["hf_path"] and a["fingerprint"] != b["fingerprint"]
    assert resolve_target(cfg_a, tmp_path)["fingerprint"] == a["fingerprint"]  # cached, stable


def test_fingerprint_ignores_the_writers_version_and_accepts_old_records(tmp_path: Path) -> None:
    """The same weights saved by another transformers version (config.json differs only in the keys the writer
    stamps) keep their fingerprint; a target.json written before those keys were left out still loads."""
    import shutil

    from draftforge.target.inspect import fingerprint

    info = resolve_target(compose("smoke", ["target=tiny-random", "target.random.seed=5"]).target, tmp_path)
    other = tmp_path / "other-writer"
    shutil.copytree(info["hf_path"], other)
    config = json.loads((other / "config.json").read_text())
    config.update(transformers_version="4.99.0", _name_or_path="/elsewhere")
    (other / "config.json").write_text(json.dumps(config))
    assert fingerprint(other) == info["fingerprint"]
    config["hidden_act"] = "gelu"  # a real change still counts
    (other / "config.json").write_text(json.dumps(config))
    assert fingerprint(other) != info["fingerprint"]
    legacy = {**info, "fingerprint": fingerprint(Path(info["hf_path"]), legacy=True)}
    assert legacy["fingerprint"] != info["fingerprint"]
    load_target_model(legacy)  # accepted: the same folder under the old rule


def test_changed_weights_are_refused_at_load(tmp_path: Path) -> None:
    info = resolve_target(compose("smoke", ["target=tiny-random", "target.random.seed=7"]).target, tmp_path)
    info = {**info, "fingerprint": "0" * 64}
    with pytest.raises(StageError, match="weights changed"):
        load_target_model(info)


def test_stage_cli_writes_target_json(tmp_path: Path) -> None:
    result = run_target_cli(tmp_path, "target=tiny-random", "tracking.enabled=false")
    assert result.returncode == 0, result.stderr
    info = read_target_info(tmp_path / "smoke" / "target" / "target.json")
    assert info["name"] == "tiny-random"
    provenance = json.loads((tmp_path / "smoke" / "target" / "provenance.json").read_text())
    assert provenance["stage"] == "target" and provenance["config"]["target"]["name"] == "tiny-random"


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("draftforge target: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0]


def test_unknown_target_name(tmp_path: Path) -> None:
    result = run_target_cli(tmp_path, "target=qwen9-1t")
    _assert_one_line_error(result, "qwen9-1t", "Available options")
    assert not (tmp_path / "smoke" / "target" / "target.json").exists()


def test_missing_model_path(tmp_path: Path) -> None:
    result = run_target_cli(tmp_path, "target.source=hf_dir", f"target.path={tmp_path}/nowhere", "tracking.enabled=false")
    _assert_one_line_error(result, "target.path", "no such directory")
    assert not (tmp_path / "smoke" / "target" / "target.json").exists()


def test_missing_hub_cache_entry(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "hf")}
    result = run_target_cli(tmp_path, "target=qwen3-8b", "tracking.enabled=false", env_extra=env)
    _assert_one_line_error(result, "Qwen/Qwen3-8B", "local HF cache")


def test_corrupt_gguf_leaves_no_partial_output(tmp_path: Path) -> None:
    pkg = tmp_path / "pkgs" / "broken_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    previous = tmp_path / "smoke" / "target" / "target.json"
    previous.parent.mkdir(parents=True)
    previous.write_text('{"kept": true}')
    result = run_target_cli(
        tmp_path, "target.package=broken_gguf_pkg", "target.gguf_file=model.gguf", "target.name=broken", "tracking.enabled=false",
        env_extra={"PYTHONPATH": str(tmp_path / "pkgs")},
    )  # fmt: skip
    _assert_one_line_error(result, "model.gguf", "not a readable GGUF")
    assert json.loads(previous.read_text()) == {"kept": True}  # nothing already written is lost
    assert not list((tmp_path / "cache").glob("targets/broken-*"))
