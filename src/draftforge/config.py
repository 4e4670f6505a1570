"""Root config schema and the Hydra compose API shared by the Snakefile and every stage (torch-free).

Invariant: the Snakefile and a stage compose the same config from the same overrides, so the plain
dict Snakemake tracks in `params` is exactly what the stage computes with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftforge.baselines.config import BaselinesConfig
from draftforge.curate.config import CurateConfig
from draftforge.drafter.registry import ignored_keys, type_of
from draftforge.drafter.settings import DrafterConfig, listed_drafters, needs_last_layer
from draftforge.errors import ConfigError
from draftforge.evaluate.config import EvaluateConfig, LongContextEvalConfig, SamplingCheckConfig, check_methods_known
from draftforge.extract.config import ExtractConfig
from draftforge.io import sha256_json
from draftforge.paths import CONF_DIR, default_results_root
from draftforge.report.config import ReportConfig
from draftforge.resources import ResourcesConfig
from draftforge.stages import STAGE_BY_NAME, STAGE_SECTIONS
from draftforge.target.config import TargetConfig
from draftforge.timing_lock import TimingLockConfig
from draftforge.train.config import TrainConfig


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""  # empty → sqlite:///<results_root>/mlflow.db


@dataclass
class RootConfig:
    experiment_name: str = "default"
    results_root: str = ""  # empty → <repo>/results (or $DRAFTFORGE_RESULTS)
    seed: int = 0
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # The machine-wide lock of evaluate's and baselines' timed part (draftforge/timing_lock.py); it changes no
    # result, so no stage's params track it.
    timing_lock: TimingLockConfig = field(default_factory=TimingLockConfig)
    # The drafters the DAG trains: conf/drafter/<name>.yaml each; train / evaluate / baselines run once per
    # name (results/<exp>/<stage>/<name>/), target / curate / extract once.
    drafters: List[str] = field(default_factory=lambda: ["dflash"])
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)  # this branch's drafter (group `drafter`)
    curate: CurateConfig = field(default_factory=CurateConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    # What each stage's job asks the scheduler for (threads, memory, wall time, partition): read by the
    # Snakemake rules only, never by a stage (draftforge.resources; docs/cluster.md).
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


ConfigStore.instance().store(name="draftforge_schema", node=RootConfig)



def compose(
    experiment: str = "default", overrides: Sequence[str] = (), conf_dir: str | Path = CONF_DIR
) -> DictConfig:
    """Compose conf/config.yaml + experiment/<experiment> + overrides; validated against RootConfig."""
    all_overrides = [f"experiment={experiment}", *overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=all_overrides)
        cfg.experiment_name = experiment  # results/<experiment>/ always matches the chosen experiment
        if not cfg.results_root:
            cfg.results_root = str(default_results_root())
        OmegaConf.resolve(cfg)
        apply_branch_steps(cfg, overrides)
        # `+key=value` overrides slip past Hydra's struct check: re-validate against the schema.
        cfg = OmegaConf.merge(OmegaConf.structured(RootConfig), OmegaConf.create(OmegaConf.to_container(cfg)))
        OmegaConf.set_struct(cfg, True)
        OmegaConf.to_object(cfg)  # builds every dataclass: their __post_init__ checks the values
        check_drafters(cfg, overrides, conf_dir)
    except (HydraException, OmegaConfBaseException, ConfigError) as exc:
        message = _explain(exc)
        raise ConfigError(f"config (experiment={experiment}, overrides={list(overrides)}): {message}") from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def apply_branch_steps(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """train.max_steps ← train.branch_max_steps[drafter name] when listed, unless the command line sets
    train.max_steps (which then holds for every branch)."""
    steps = cfg.train.branch_max_steps
    if cfg.drafter.name in steps and not any(override_key(o) == "train.max_steps" for o in overrides):
        cfg.train.max_steps = int(steps[cfg.drafter.name])


def check_drafters(cfg: DictConfig, overrides: Sequence[str], conf_dir: str | Path) -> None:
    """Every name in `drafters` has its conf/drafter file (its type registered), a chosen group option names
    itself, and every `evaluate.methods` name is known once the listed types are loaded."""
    for drafter in listed_drafters(cfg, conf_dir).values():
        type_of(drafter)  # imports a plugin type's module: its methods become known
    chosen = [o.split("=", 1)[1] for o in overrides if override_key(o) == "drafter"]
    if chosen and chosen[-1] != cfg.drafter.name:
        raise ConfigError(f"conf/drafter/{chosen[-1]}.yaml: name is {cfg.drafter.name!r}; set `name: {chosen[-1]}` "
                          "(the branch's folders are named after it)")
    check_methods_known(list(cfg.evaluate.methods))


def branch_overrides(drafter: str | None) -> list[str]:
    """The override that composes one drafter branch (none for the stages that run once)."""
    return [f"drafter={drafter}"] if drafter else []


def _explain(exc: BaseException) -> str:
    """One line from an exception chain (Hydra wraps the OmegaConf error that names the key)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        text = " ".join(str(seen).split())
        if text and text not in parts:
            parts.append(text)
        seen = seen.__cause__ or seen.__context__
    return ": ".join(parts)


def to_plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


# Values derived from several sections that a stage's computation depends on, tracked under `derived`
# instead of the sections themselves (extract stores the last layer iff some listed drafter reads it; adding
# a drafter that does not must not rerun extract).
DERIVED_PARAMS = {"stores_last_layer": needs_last_layer}

# Options added after results were produced with the code before them: left out of a stage's params while
# at their default (= the behaviour before the option existed), so upgrading never reruns finished stages
# whose computation the option does not change (or changes only in floating-point rounding: extract.batch_fill
# batches the same sequences differently). Setting one to another value changes the params as usual.
ADDED_OPTIONS: dict[str, Any] = {"drafter.acceptance_weighting": False, "drafter.module": "",
                                 "target.chat_template_kwargs": {}, "evaluate.allow_chat_mode_mismatch": False,
                                 "baselines.allow_chat_mode_mismatch": False, "extract.jobs": 1, "extract.part": -1,
                                 "extract.batch_fill": 0.9,
                                 "evaluate.sampled_datasets": [], "evaluate.sampled_prompts": 0,
                                 "evaluate.sampling_check": asdict(SamplingCheckConfig()),
                                 "baselines.temperatures": None, "drafter.draft_vocab_size": 0,
                                 "train.replay_from": 0.0, "train.replay_share": 0.5, "train.replay_rows": 256}
# Keys a stage tracks since after results existed (stage → {key: value before}): left out of that stage's params
# at that value, as ADDED_OPTIONS, for that stage only (the stages that tracked them all along keep them).
NEWLY_TRACKED: dict[str, dict[str, Any]] = {
    # the long-context set's prompts (curate decontaminates against them, baselines renders them)
    "curate": {"evaluate.long_context": asdict(LongContextEvalConfig())},
    # vLLM's temperatures and their T > 0 prompts follow evaluate's (evaluate/prompts.prompts_at)
    "baselines": {"evaluate.long_context": asdict(LongContextEvalConfig()), "evaluate.temperatures": [0.0],
                  "evaluate.sampled_datasets": [], "evaluate.sampled_prompts": 0},
}


def stage_params(cfg: DictConfig, stage: str) -> dict[str, Any]:
    """The resolved plain dict a stage computes with: what Snakemake tracks in `params`."""
    view: dict[str, Any] = {"experiment_name": cfg.experiment_name, "seed": cfg.seed}
    for name in STAGE_BY_NAME[stage].derived:
        view.setdefault("derived", {})[name] = DERIVED_PARAMS[name](cfg)
    for key in STAGE_SECTIONS[stage]:
        *parents, leaf = key.split(".")
        node, into = cfg, view
        for part in parents:
            node, into = node[part], into.setdefault(part, {})
        into[leaf] = to_plain(node[leaf])
    for key, default in [*ADDED_OPTIONS.items(), *NEWLY_TRACKED.get(stage, {}).items()]:
        _drop(view, key, lambda value, default=default: value == default)
    _drop(view, "train.branch_max_steps")  # resolved into train.max_steps per branch (apply_branch_steps)
    if STAGE_BY_NAME[stage].per_drafter and "drafter" in cfg:  # keys this branch's type never reads
        for key in ignored_keys(cfg.drafter):
            _drop(view, key)
    return view


def _drop(view: dict[str, Any], key: str, when: Any = None) -> None:
    """Remove dotted `key` from the nested params dict (if present and `when(value)`, when given)."""
    *parents, leaf = key.split(".")
    into: Any = view
    for part in parents:
        into = into.get(part) if isinstance(into, dict) else None
    if isinstance(into, dict) and leaf in into and (when is None or when(into[leaf])):
        del into[leaf]


def config_hash(cfg: DictConfig, stage: str) -> str:
    return sha256_json(stage_params(cfg, stage))[:16]


GLOBAL_KEYS: tuple[str, ...] = ("seed", "results_root", "tracking")


def override_key(override: str) -> str:
    """'++evaluate.budgets=[16]' → 'evaluate.budgets'; 'target=qwen3-8b' → 'target'."""
    return override.split("=", 1)[0].lstrip("+~")


def stage_overrides(stage: str, overrides: Sequence[str], ignored: Sequence[str] = ()) -> list[str]:
    """The overrides that can change what `stage` computes (its sections and global keys), and for a timing
    stage the timing lock's settings (they reach the stage only on its command line), less those that set
    only keys in `ignored` (a branch's `registry.ignored_keys`, or under one of them).

    Passing a stage only these keeps its command line, and so Snakemake's rerun decision, independent
    of overrides aimed at other stages or other branches' types; what it computes is unchanged since it
    reads only its sections, and a branch never reads its type's ignored keys.
    """
    keys = STAGE_SECTIONS[stage] + GLOBAL_KEYS + (("timing_lock",) if STAGE_BY_NAME[stage].timing else ())

    def reads(key: str) -> bool:  # the override sets a key the stage reads, or a parent of one
        if any(key == k or key.startswith(k + ".") for k in ignored):
            return False
        return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys)

    return [o for o in overrides if reads(override_key(o))]
