"""Config tree: every experiment × target composes; typos and wrong types fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.config import compose, stage_overrides, stage_params
from draftforge.errors import ConfigError
from draftforge.paths import CONF_DIR
from draftforge.stages import STAGES
from draftforge.target.config import default_tap_ids

TARGETS = sorted(p.stem for p in (CONF_DIR / "target").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_required_groups_exist() -> None:
    for name in ("smollm2-135m", "qwen3-8b", "qwen3-4b", "llama3.1-8b", "qwen3.6-27b", "tiny-random"):
        assert name in TARGETS
    assert {"default", "smoke"} <= set(EXPERIMENTS)
    for stage in STAGES:  # a stage's defaults live in its dataclass only
        assert not (CONF_DIR / stage).exists() or stage == "target"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_experiment_and_target_composes(experiment: str, target: str) -> None:
    cfg = compose(experiment, [f"target={target}"])
    assert cfg.experiment_name == experiment
    assert cfg.target.name == target
    assert Path(cfg.results_root).is_absolute()
    for stage in ("target", "curate", "extract", "train", "evaluate", "baselines", "report"):
        params = stage_params(cfg, stage)
        assert isinstance(params, dict) and params["experiment_name"] == experiment


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+curate.not_a_key=3", "not_a_key"),
        ("train.lr=fast", "train.lr"),
        ("target.drafter.n_taps=five", "target.drafter.n_taps"),
        ("target=no-such-target", "no-such-target"),
        ("target.source=ftp", "target.source"),
        ("evaluate.budgets=[0]", "evaluate.budgets"),
        ("evaluate.budgets=[16,100000]", "evaluate.budgets: [16, 100000]: a tree budget above 4096 nodes is refused"),
        ("evaluate.max_new_tokens=100000000", "evaluate.max_new_tokens: 100000000 is above the limit of 32768"),
        ("baselines.max_new_tokens=100000000", "baselines.max_new_tokens: 100000000 must be in [1, 32768]"),
        ("evaluate.engine=bogus", "evaluate.engine: 'bogus' is not one of ['eager', 'captured', 'compiled']"),
        ("curate.sources=[]", "curate.sources"),
        ("baselines.concurrency=[0]", "baselines.concurrency"),
        ("extract.storage_dtype=int4", "extract.storage_dtype"),
        ("drafter.block_size=1", "drafter.block_size"),
        ("drafter.type=medusa", "drafter.type"),
        ("drafters=[dflash,nope]", "drafters: 'nope'"),
        ("drafters=[]", "drafters"),
        ("drafter=nope", "nope"),
        ("evaluate.methods=[ar,dsprk]", "evaluate.methods: unknown ['dsprk']; known: ar, "),
    ],
)
def test_bad_config_names_the_key(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose("default", [override])
    assert named in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_in_a_yaml_file_fails_at_compose(tmp_path: Path) -> None:
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "default.yaml").write_text("# @package _global_\ntrain:\n  lr: 1e-3\n  learning_rate_typo: 2\n")
    with pytest.raises(ConfigError, match="learning_rate_typo"):
        compose("default", conf_dir=conf)


def test_a_misspelt_method_fails_at_compose_naming_the_known_ones(tmp_path: Path) -> None:
    """A method name no branch runs was dropped by every branch's filter (only the AR row, exit 0)."""
    import shutil

    with pytest.raises(ConfigError, match=r"evaluate.methods: unknown \['dsprk'\]; known: ar, .*dspark, ddtree") as err:
        compose("smoke-hybrid", ["evaluate.methods=[ar,dsprk]"])
    assert "\n" not in str(err.value)
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "default.yaml").write_text("# @package _global_\nbaselines:\n  methods:\n    dsprk: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"baselines.methods: unknown \['dsprk'\]; known: ar, ngram"):
        compose("default", conf_dir=conf)


def test_a_captured_engine_too_small_for_the_answers_fails_at_compose() -> None:
    with pytest.raises(ConfigError, match=r"evaluate.engine_capacity: 128 rows cannot hold evaluate.max_new_tokens 64 "
                                          r"\+ a verify of 65"):
        compose("default", ["evaluate.engine=captured", "evaluate.engine_capacity=128", "evaluate.budgets=[4,64]"])
    assert compose("default", ["evaluate.engine=captured", "evaluate.engine_capacity=256"]).evaluate.engine_capacity == 256
    compose("default", ["evaluate.engine_capacity=128"])  # eager: the capacity is unused


def test_smoke_runs_train_the_mtp_head_a_few_steps() -> None:
    cfg = compose("smoke-hybrid")
    assert "mtp" in cfg.drafters and cfg.train.mtp_steps <= cfg.train.max_steps  # minutes, not the default 2,000
    assert cfg.train.mtp_eval_every <= cfg.train.mtp_steps


def test_stage_overrides_keep_only_what_a_stage_reads() -> None:
    overrides = ["evaluate.budgets=[16]", "target=tiny-random", "seed=3", "+train.lr=1", "curate.max_rows=5",
                 "evaluate.gsm_symbolic.seed=7"]  # fmt: skip
    assert stage_overrides("evaluate", overrides) == ["evaluate.budgets=[16]", "target=tiny-random", "seed=3", "evaluate.gsm_symbolic.seed=7"]
    assert stage_overrides("report", overrides) == ["seed=3"]
    assert stage_overrides("train", overrides) == ["target=tiny-random", "seed=3", "+train.lr=1"]
    # held-out prompt seeds change what curate removes and what baselines runs on, budgets do not
    assert stage_overrides("curate", overrides) == ["target=tiny-random", "seed=3", "curate.max_rows=5", "evaluate.gsm_symbolic.seed=7"]
    assert stage_overrides("baselines", overrides) == ["target=tiny-random", "seed=3", "evaluate.gsm_symbolic.seed=7"]


def test_stage_params_hold_only_what_the_stage_reads() -> None:
    cfg = compose("smoke")
    params = stage_params(cfg, "baselines")
    assert set(params) == {"experiment_name", "seed", "target", "drafter", "baselines", "evaluate"}
    assert set(params["evaluate"]) == {"datasets", "dataset_files", "gsm_symbolic", "chitchat", "num_prompts", "max_new_tokens",
                                       "temperatures", "sampled_datasets"}  # sampled_prompts: at its default (ADDED_OPTIONS)
    assert "budgets" not in params["evaluate"]


def test_an_added_option_at_its_default_leaves_the_params_as_before() -> None:
    """A new option at its default is the old behaviour: it must not change params (Snakemake would rerun
    every finished stage on upgrade); set to anything else it does."""
    from draftforge.config import ADDED_OPTIONS, compose, stage_params
    from draftforge.stages import STAGE_SECTIONS

    other = {"drafter.module": ("drafter.module=draftforge.drafter.types.dflash", "draftforge.drafter.types.dflash"),
             "target.chat_template_kwargs": ("++target.chat_template_kwargs.enable_thinking=false",
                                             {"enable_thinking": False}),
             "extract.jobs": ("extract.jobs=2", 2), "extract.part": ("extract.part=0", 0),
             "extract.batch_fill": ("extract.batch_fill=0.0", 0.0),
             "evaluate.sampled_datasets": ("evaluate.sampled_datasets=[humaneval]", ["humaneval"]),
             "evaluate.sampled_prompts": ("evaluate.sampled_prompts=1", 1),
             "evaluate.sampling_check": ("evaluate.sampling_check.bins=20", {"enabled": True, "bins": 20, "alpha": 0.001}),
             "baselines.temperatures": ("baselines.temperatures=[0.0]", [0.0]),
             "drafter.draft_vocab_size": ("drafter.draft_vocab_size=64", 64),
             "train.replay_from": ("train.replay_from=0.5", 0.5), "train.replay_share": ("train.replay_share=0.25", 0.25),
             "train.replay_rows": ("train.replay_rows=8", 8)}  # (override, value)
    base = ["target=tiny-random", "evaluate.sampled_datasets=[]"]  # smoke samples mt_bench; the default samples all
    for key in ADDED_OPTIONS:
        section, leaf = key.split(".")
        stage = next(s for s, sections in STAGE_SECTIONS.items() if section in sections)  # a stage tracking it
        plain = stage_params(compose("smoke", base), stage)
        assert leaf not in plain[section], key
        override, value = other.get(key, (f"{key}=true", True))
        changed = stage_params(compose("smoke", [*base, override]), stage)
        assert changed[section][leaf] == value and changed != plain, key


def test_default_taps_match_published_drafters() -> None:  # reference rule: tests/unit/test_train_recipe.py
    assert default_tap_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_tap_ids(64, 5) == [1, 16, 31, 46, 61]
    with pytest.raises(ValueError):
        default_tap_ids(3, 2)


@pytest.mark.parametrize("drafter", sorted(p.stem for p in (CONF_DIR / "drafter").glob("*.yaml")))
def test_every_drafter_file_composes_as_a_branch(drafter: str) -> None:
    """Each conf/drafter file names itself, composes as a branch and, listed, decides the extract features."""
    from draftforge.drafter.settings import needs_last_layer

    cfg = compose("default", [f"drafters=[{drafter}]", f"drafter={drafter}"])
    assert cfg.drafter.name == drafter
    if cfg.drafter.type != "mtp":  # an MTP head reads the last layer when it is trained (target-dependent)
        reads_target = (cfg.drafter.type == "dspark" or bool(cfg.drafter.acceptance_weighting)
                        or (cfg.drafter.loss_tv or 0) > 0 or (cfg.drafter.loss_kl or 0) > 0)
        assert needs_last_layer(cfg) == reads_target


def test_a_listed_drafter_reads_as_its_branch_composes_it(tmp_path) -> None:
    """Listed drafters (not the composed branch) are read through Hydra too: a file extending another drafter
    inherits its fields, and a bad key names the file."""
    import shutil

    from draftforge.drafter.settings import listed_drafters

    other = compose("default", ["drafter=mtp"])  # dflash_aw_b4 listed, not composed
    listed = listed_drafters(other, CONF_DIR)["dflash_aw_b4"]
    assert listed == compose("default", ["drafter=dflash_aw_b4"]).drafter
    assert listed.acceptance_weighting and listed.draft_vocab_size == 8192  # from conf/drafter/dflash_aw.yaml
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "drafter" / "dflash_aw_b4.yaml").write_text("defaults:\n  - dflash_aw\n  - _self_\nname: dflash_aw_b4\nblok_size: 4\n")
    with pytest.raises(ConfigError, match=r"dflash_aw_b4\.yaml.*blok_size"):
        compose("default", ["drafter=mtp"], conf_dir=conf)


def test_the_timing_lock_reaches_only_the_timing_stages_and_is_no_param() -> None:
    """timing_lock.* changes no result: no stage's params hold it, and only evaluate and baselines (the stages that
    take the lock) get the override on their command line."""
    overrides = ["timing_lock.timeout_s=60", "timing_lock.dir=/shared/locks"]
    assert stage_overrides("evaluate", overrides) == overrides and stage_overrides("baselines", overrides) == overrides
    assert stage_overrides("train", overrides) == [] and stage_overrides("report", overrides) == []
    cfg = compose("smoke", overrides)
    assert cfg.timing_lock.timeout_s == 60 and cfg.timing_lock.dir == "/shared/locks"
    assert all("timing_lock" not in stage_params(cfg, s) for s in ("evaluate", "baselines"))
    assert stage_params(cfg, "evaluate") == stage_params(compose("smoke"), "evaluate")


def test_newly_tracked_keys_change_a_stage_params_only_when_set() -> None:
    """Keys curate / baselines track since after results existed (config.NEWLY_TRACKED): absent at their old
    value, so finished runs stay finished; changed, they rerun the stage (a long-context set of another size
    is other prompts to decontaminate against and to render for vLLM)."""
    from draftforge.config import stage_params

    base = ["target=tiny-random", "evaluate.sampled_datasets=[]", "evaluate.temperatures=[0.0]"]
    for stage in ("curate", "baselines"):
        plain = stage_params(compose("smoke", base), stage)
        assert "long_context" not in plain["evaluate"] and "temperatures" not in plain["evaluate"], stage
        sized = stage_params(compose("smoke", [*base, "evaluate.long_context.size=4"]), stage)
        assert sized["evaluate"]["long_context"] == {"min_tokens": 4096, "size": 4}, stage
    sampled = stage_params(compose("smoke", [*base[:-1], "evaluate.temperatures=[0.0,1.0]"]), "baselines")
    assert sampled["evaluate"]["temperatures"] == [0.0, 1.0]
    assert "temperatures" not in stage_params(compose("smoke", [*base[:-1], "evaluate.temperatures=[0.0,1.0]"]), "curate")["evaluate"]


def test_branch_max_steps_train_one_branch_longer_and_the_command_line_wins() -> None:
    aw, ds = compose("default", ["drafter=dflash_aw"]), compose("default", ["drafter=dspark"])
    assert (aw.train.max_steps, ds.train.max_steps) == (3000, 1000)  # conf/experiment/default.yaml
    assert compose("default", ["drafter=dflash_aw", "train.max_steps=7"]).train.max_steps == 7
    # The table itself is no stage param: another branch's entry never reruns this branch (or moves its resume key).
    other = compose("default", ["drafter=dspark", "train.branch_max_steps={dflash_aw: 50}"])
    assert stage_params(other, "train") == stage_params(ds, "train")
    assert "branch_max_steps" not in stage_params(aw, "train")["train"]
    assert stage_params(aw, "train")["train"]["max_steps"] == 3000
    with pytest.raises(ConfigError, match=r"train.branch_max_steps.*must be -1 \(all epochs\) or >= 1"):
        compose("default", ["train.branch_max_steps={dflash_aw: 0}"])
