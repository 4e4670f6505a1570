"""The target owns the chat mode (`target.chat_template_kwargs`): each stage renders every conversation through
`draftforge.chat` with the one `ChatMode` its config declares, curate records it, train carries it forward, and
evaluate / baselines refuse a drafter trained in another mode (or, when told to, run it and label the rows)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from curate_fixtures import (
    NO_THINKING_BLOCK,
    QWEN3_THINKING_SWITCH_TEMPLATE,
    SMOLLM2_TEMPLATE,
    chat_records,
    make_ctx,
    template_tokenizer,
    with_template,
    write_jsonl,
)
from draftforge.chat import ChatMode, check_served, prompt_ids, render_text
from draftforge.cli import run_stage
from draftforge.config import compose, stage_overrides, stage_params
from draftforge.errors import StageError
from draftforge.io import write_json

NON_THINKING = "++target.chat_template_kwargs.enable_thinking=false"
OFF = ChatMode.from_kwargs({"enable_thinking": False})
CONVS = [
    [{"role": "user", "content": "Name a prime."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}],
]


def _todays_prompt_ids(tokenizer, messages) -> list[int]:
    """chat.prompt_ids before the chat mode existed: the template applied without options."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def test_prompt_ids_follow_the_target_configs_chat_mode():
    tok = template_tokenizer(QWEN3_THINKING_SWITCH_TEMPLATE)
    thinking = ChatMode.of(compose("smoke", ["target=tiny-random"]))
    non_thinking = ChatMode.of(compose("smoke", ["target=tiny-random", NON_THINKING]))
    assert thinking == ChatMode() and non_thinking == OFF and str(non_thinking) == "{enable_thinking: false}"
    block = tok.encode(NO_THINKING_BLOCK, add_special_tokens=False)
    for msgs in CONVS:
        on, off = prompt_ids(tok, msgs, thinking), prompt_ids(tok, msgs, non_thinking)
        assert on == _todays_prompt_ids(tok, msgs) and off == on + block
        assert (render_text(tok, msgs, non_thinking, generation_prompt=True)
                == render_text(tok, msgs, thinking, generation_prompt=True) + NO_THINKING_BLOCK)


def test_each_target_file_declares_its_mode():
    """Qwen3 hybrid-thinking targets serve non-thinking; templates without the switch declare nothing."""
    want = {"qwen3-8b": {"enable_thinking": False}, "qwen3-4b": {"enable_thinking": False},
            "qwen3.6-27b": {"enable_thinking": False}, "qwen3-coder-30b-a3b": {}, "llama3.1-8b": {},
            "smollm2-135m": {}, "tiny-random": {}, "qwen3-8b-random": {}}
    assert {t: ChatMode.of(compose("smoke", [f"target={t}"])).kwargs for t in want} == want


def test_default_world_template_keeps_todays_ids():
    cfg = compose("smoke")
    mode = ChatMode.of(cfg)
    assert cfg.target.name == "smollm2-135m" and mode == ChatMode()
    assert "chat_template_kwargs" not in stage_params(cfg, "curate")["target"]  # params as before: nothing reruns
    tok = template_tokenizer(SMOLLM2_TEMPLATE)
    for msgs in CONVS:
        assert prompt_ids(tok, msgs, mode) == _todays_prompt_ids(tok, msgs)
        assert render_text(tok, msgs, mode) == tok.apply_chat_template(msgs, tokenize=False)


def test_the_mode_is_in_the_params_that_decide_reruns():
    """Snakemake reruns target and curate (and everything after them by file dependency) when the mode changes."""
    plain = compose("smoke", ["target=tiny-random"])
    off = compose("smoke", ["target=tiny-random", NON_THINKING])
    for stage in ("target", "curate"):
        assert stage_params(off, stage)["target"]["chat_template_kwargs"] == {"enable_thinking": False}
        assert stage_params(off, stage) != stage_params(plain, stage)
    assert stage_overrides("curate", [NON_THINKING]) == [NON_THINKING]


def test_curate_masks_only_the_answer_in_either_mode():
    from draftforge.curate.tokenize import end_of_turn_ids, tokenize_conversation

    tok = template_tokenizer(QWEN3_THINKING_SWITCH_TEMPLATE)
    conv = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    for mode in (ChatMode(), OFF):
        out = tokenize_conversation(tok, conv, end_of_turn_ids(tok), "last", mode=mode)
        assert tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m]) == "Seven.<|im_end|>"


class _RecordingBackend:
    """Answers every prompt with "Sure." and keeps the prompt ids it was given."""

    name = "recording"

    def __init__(self, seen: list[list[int]]) -> None:
        self.seen = seen

    def generate(self, prompts, seeds):
        from draftforge.curate.regenerate import Generation

        self.seen += prompts
        return [Generation([], "Sure.", True) for _ in prompts]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("overrides", [(), (NON_THINKING,)], ids=["template-defaults", "non-thinking"])
def test_curate_regenerates_in_the_targets_mode_and_records_it(tmp_path, tiny_target_info, overrides):
    import pyarrow.parquet as pq

    from draftforge.cli import write_stage_provenance
    from draftforge.curate import stage as curate_stage

    info = with_template(tiny_target_info, QWEN3_THINKING_SWITCH_TEMPLATE, into=tmp_path / "target")
    src = write_jsonl(tmp_path / "data" / "a.jsonl", chat_records(10))
    ctx = make_ctx(tmp_path, info, [{"name": "a", "kind": "jsonl", "path": str(src)}], overrides)
    want = {"enable_thinking": False} if overrides else {}
    seen: list[list[int]] = []
    curate_stage.main(ctx, make_backend=lambda: _RecordingBackend(seen))
    write_stage_provenance(ctx)

    block = template_tokenizer(QWEN3_THINKING_SWITCH_TEMPLATE).encode(NO_THINKING_BLOCK, add_special_tokens=False)
    assert len(seen) == 10 and all((p[-len(block):] == block) == bool(want) for p in seen)
    assert json.loads((ctx.out_dir / "manifest.json").read_text())["chat_template_kwargs"] == want
    assert json.loads((ctx.out_dir / "provenance.json").read_text())["chat_template_kwargs"] == want
    tok = template_tokenizer(QWEN3_THINKING_SWITCH_TEMPLATE)
    for shard in ctx.out_dir.glob("*.parquet"):
        t = pq.read_table(shard)
        for ids, mask in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist()):
            assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Sure.<|im_end|>"


def test_train_records_the_mode_of_the_data_it_trained_on(tmp_path):
    from draftforge.train.stage import data_chat_mode

    index, manifest = tmp_path / "index.json", tmp_path / "manifest.json"
    write_json(index, {"chat_template_kwargs": {"enable_thinking": False}})  # extract carries curate's record
    write_json(manifest, {"format": "draftforge.curate/1"})  # written before the option: the template's defaults
    ctx = SimpleNamespace(input_marker=lambda stage: index if stage == "extract" else manifest)
    assert data_chat_mode(ctx, SimpleNamespace(features="offline")) == OFF
    assert data_chat_mode(ctx, SimpleNamespace(features="online")) == ChatMode()


def test_a_drafter_served_in_another_mode_is_one_line_or_a_label(tmp_path):
    marker = tmp_path / "metrics.json"
    write_json(marker, {"chat_template_kwargs": {"enable_thinking": False}})
    key = "evaluate.allow_chat_mode_mismatch"
    assert check_served(OFF, marker, key, allowed=False) is None
    with pytest.raises(StageError) as err:
        check_served(ChatMode(), marker, key, allowed=False)
    msg = str(err.value)
    assert "\n" not in msg and "trained with target.chat_template_kwargs={enable_thinking: false} but served with {}" in msg
    assert "++target.chat_template_kwargs.enable_thinking=false" in msg and f"{key}=true" in msg
    assert check_served(ChatMode(), marker, key, allowed=True) == "trained {enable_thinking: false}, served {}"


def _evaluate_args(root: Path, *extra: str) -> list[str]:
    return ["experiment=smoke", "target=tiny-random", f"results_root={root}", "tracking.enabled=false",
            "evaluate.datasets=[chitchat]", "evaluate.num_prompts=1", "evaluate.calibration_prompts=0",
            "evaluate.max_new_tokens=6", "evaluate.methods=[ar,dflash]", "evaluate.repeats=1", "evaluate.warmup=0",
            NON_THINKING, *extra]


def test_evaluate_refuses_a_drafter_trained_in_another_mode_and_labels_it_when_allowed(tmp_path, capsys, monkeypatch):
    from draftforge.evaluate import stage
    from draftforge.evaluate.prompts import eval_prompt_sets
    from draftforge.evaluate.runner import split_turns
    from evaluate_fixtures import tiny_pipeline

    info = with_template(tiny_pipeline(tmp_path), QWEN3_THINKING_SWITCH_TEMPLATE)  # train marker: no mode = {}
    load_engines = stage.load_engines
    monkeypatch.setattr(stage, "load_engines", lambda *a: pytest.fail("loaded models before refusing"))
    with pytest.raises(SystemExit) as exit_:
        run_stage("evaluate", stage.main, argv=_evaluate_args(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("draftforge evaluate: error: "), err
    assert "trained with target.chat_template_kwargs={} but served with {enable_thinking: false}" in err[-1]
    assert "~target.chat_template_kwargs.enable_thinking" in err[-1] and "evaluate.allow_chat_mode_mismatch=true" in err[-1]

    monkeypatch.setattr(stage, "load_engines", load_engines)
    run_stage("evaluate", stage.main, argv=_evaluate_args(tmp_path, "evaluate.allow_chat_mode_mismatch=true"))
    out = tmp_path / "smoke" / "evaluate" / "dflash"
    marker = json.loads((out / "evaluate.json").read_text())
    assert marker["chat_template_kwargs"] == {"enable_thinking": False}
    assert [r["method"] for r in marker["rows"]] == ["ar", "dflash"]
    assert {r["chat_mode_mismatch"] for r in marker["rows"]} == {"trained {}, served {enable_thinking: false}"}
    assert json.loads((out / "provenance.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    prompt = eval_prompt_sets(compose("smoke", _evaluate_args(tmp_path)[1:]), limit=1)["chitchat"][0]
    from draftforge.target.load import load_tokenizer

    served = len(prompt_ids(load_tokenizer(info), split_turns(prompt)[0], OFF))  # the prompt in the served mode
    responses = json.loads((out / "chitchat.json").read_text())["responses"]
    assert {r["prompt_len"] for r in responses if r["turn"] == 0} == {served}


def test_baselines_refuses_a_drafter_trained_in_another_mode_and_labels_it_when_allowed(tiny_target_info, tmp_path,
                                                                                       capsys, monkeypatch):
    from baselines_fixtures import export_random_drafter
    from draftforge.baselines import stage

    root = tmp_path / "results"
    write_json(root / "smoke" / "target" / "target.json", tiny_target_info)
    export_random_drafter(tiny_target_info, root / "smoke" / "train" / "dflash" / "drafter")
    write_json(root / "smoke" / "train" / "dflash" / "metrics.json", {"chat_template_kwargs": {}})
    args = ["experiment=smoke", f"results_root={root}", "target=tiny-random", "tracking.enabled=false",
            "baselines.datasets=[humaneval]", "baselines.num_prompts=1", "baselines.max_new_tokens=8", NON_THINKING]
    with pytest.raises(SystemExit) as exit_:
        run_stage("baselines", stage.main, args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("draftforge baselines: error: "), err
    assert "served with {enable_thinking: false}" in err[-1] and "baselines.allow_chat_mode_mismatch=true" in err[-1]
    assert not (root / "smoke" / "baselines" / "dflash" / "baselines.json").exists()

    monkeypatch.setattr(stage, "vllm_missing_reason", lambda: "no engine in this test")  # recorded skips, no worker
    run_stage("baselines", stage.main, [*args, "baselines.allow_chat_mode_mismatch=true"])
    marker = json.loads((root / "smoke" / "baselines" / "dflash" / "baselines.json").read_text())
    assert marker["chat_template_kwargs"] == {"enable_thinking": False} and marker["rows"]
    assert {r["chat_mode_mismatch"] for r in marker["rows"]} == {"trained {}, served {enable_thinking: false}"}


def test_the_report_keeps_the_label():
    import csv
    import io

    from draftforge.report.stage import markdown_table, summary_csv
    from draftforge.rows import new_row

    rows = [new_row("chitchat", "dflash", "draftforge", 0.0, drafter="dflash"),
            new_row("chitchat", "dflash", "vllm", 0.0, drafter="dflash", chat_mode_mismatch="trained {}, served {x: 1}")]
    table = list(csv.DictReader(io.StringIO(summary_csv(rows))))
    assert [r["chat_mode_mismatch"] for r in table] == ["", "trained {}, served {x: 1}"]
    assert markdown_table(rows).splitlines()[-1].endswith("ok (chat mode mismatch: trained {}, served {x: 1}) |")
