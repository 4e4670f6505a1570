"""Typed config of the `drafter` group (conf/drafter/<name>.yaml) and the per-drafter branch rules (torch-free).

An experiment lists the drafters it trains (`drafters: [dflash, dspark, mtp]`); `train`, `evaluate` and
`baselines` run once per listed drafter (results/<exp>/<stage>/<name>/), composed with `drafter=<name>`,
while `target`, `curate` and `extract` run once. The target fixes what every drafter shares (tapped
layers, mask token: `target.drafter`); this group owns the drafter's shape and heads, so a block-size
sweep reruns train and its descendants only.

Branch rules, all read from the branch's drafter type (drafter/registry.py; one module per type under
drafter/types/, or a plugin module named by `drafter.module`):
  - `branch_methods`: the engine methods a branch measures (always `ar`, the speedup reference measured
    in the same run, plus its type's engine methods);
  - `branch_vllm_methods`: the same for vLLM (its type's vLLM methods, drafter-free riders included);
  - `needs_last_layer`: whether extract stores the target's final-normed last layer (any listed drafter's
    type reads it, or its objective uses the target's next-token distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from draftforge.drafter.registry import AR, drafter_type, drafter_types, load_module, type_of
from draftforge.errors import ConfigError, check


@dataclass
class DrafterConfig:
    # The group option's name (conf/drafter/<name>.yaml); names the branch's folders. Set in each file.
    name: str = "dflash"
    # A registered drafter type (drafter/registry.py): dflash (the block-diffusion drafter), dspark (DFlash
    # backbone + Markov and confidence heads), mtp (the target's MTP layer or a trained MTP head), or a plugin's.
    type: str = "dflash"
    # Importable module registering `type` when it is not built in (a plugin type); empty for built-ins.
    module: str = ""
    num_layers: int = 5
    block_size: int = 16
    # Sliding-window draft layers (the published Qwen3.6-27B drafter); 0 = all full attention.
    sliding_window: int = 0
    # DSpark heads (type dspark only).
    markov_rank: int = 256  # Markov head rank (0: none)
    confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head's input is [hidden; Markov embedding]
    bonus_anchor: bool = False  # False = every slot predicts the next position (vLLM's default DSpark block)
    # Objective: weights of the terms ce / kl / tv (tv = ½L1 to the target's next-token distribution).
    # All null → the type's default (dflash: ce 1.0; dspark: tv 1.8 + ce 0.1, i.e. 0.9 × L1 + 0.1 × CE);
    # any set → exactly those (unset ones 0). A DFlash drafter trained on the target's distribution is a
    # drafter file with loss_tv / loss_kl set.
    loss_ce: Optional[float] = None
    loss_kl: Optional[float] = None
    loss_tv: Optional[float] = None
    # Weight each draft position by the chance the verifier reaches it as well as by exp(−k/γ): the product
    # of the analytic acceptances 1 − tv of the block's earlier draft positions (detached; needs the target's
    # distribution, so extract stores its last layer). Positions the drafter already loses count less.
    acceptance_weighting: bool = False
    # Draft from the D most frequent answer tokens of the train split instead of the target's whole vocabulary
    # (0: the whole vocabulary). The drafter's LM head is then the target's D rows (frozen, as the whole head is):
    # training and each block pass multiply by a D-row head instead of a V-row one; a token outside the D is
    # never drafted (its positions are learnt by no head row, and the verifier rejects nothing for it: decoding
    # stays lossless). Exported as vLLM's `draft_vocab_size` + `d2t` + `lm_head` (docs/architecture.md,
    # "Draft vocabulary"). Types whose `DrafterType.draft_vocab` is False refuse it.
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "drafter.name", f"{self.name!r} must be a plain file name")
        if self.module:
            load_module(self.module)
        check(self.type in drafter_types(), "drafter.type", f"{self.type!r}: use one of {list(drafter_types())}")
        check(self.num_layers >= 1, "drafter.num_layers", f"{self.num_layers} must be >= 1")
        check(self.block_size >= 2, "drafter.block_size", f"{self.block_size} must be >= 2")
        check(self.sliding_window >= 0, "drafter.sliding_window", f"{self.sliding_window} must be >= 0")
        check(self.markov_rank >= 0, "drafter.markov_rank", f"{self.markov_rank} must be >= 0")
        check(self.draft_vocab_size >= 0, "drafter.draft_vocab_size", f"{self.draft_vocab_size} must be >= 0 (0: the whole vocabulary)")
        check(not self.draft_vocab_size or type_of(self).draft_vocab, "drafter.draft_vocab_size",
              f"{self.draft_vocab_size}: a {self.type} drafter drafts from the whole vocabulary (set 0)")
        for term in ("ce", "kl", "tv"):
            w = getattr(self, f"loss_{term}")
            check(w is None or w >= 0, f"drafter.loss_{term}", f"{w} must be >= 0")


def branch_methods(type_name: str, methods: Iterable[str]) -> list[str]:
    """The engine methods (of evaluate.methods, in their order) a branch of this drafter type runs."""
    mine = (AR, *drafter_type(type_name).engine_methods)
    return [m for m in methods if m in mine]


def branch_vllm_methods(type_name: str, methods: Iterable[str]) -> list[str]:
    """The vLLM methods (of the enabled baselines.methods) a branch of this drafter type runs."""
    mine = (AR, *drafter_type(type_name).vllm_methods)
    return [m for m in methods if m in mine]


def default_loss_weights(drafter_type_name: str) -> dict[str, float]:
    """The type's objective when a drafter sets no weight (dflash: CE against the data tokens; dspark:
    0.9 × L1 + 0.1 × CE, tv = ½L1 so tv weight 1.8)."""
    return dict(drafter_type(drafter_type_name).default_loss_weights)


def effective_loss_weights(drafter: Any) -> dict[str, float]:
    """The objective's term weights: the drafter's own when any is set, else its type's default."""
    given = {t: getattr(drafter, f"loss_{t}", None) for t in ("ce", "kl", "tv")}
    if any(v is not None for v in given.values()):
        return {t: float(v) for t, v in given.items() if v}
    return dict(type_of(drafter).default_loss_weights)


def listed_drafters(cfg: Any, conf_dir: str | Path) -> dict[str, Any]:
    """name → the DrafterConfig of every drafter the experiment lists, read from conf/drafter/<name>.yaml
    (the branch currently composed keeps its command-line overrides). One clear error per bad name."""
    from omegaconf import OmegaConf

    names = list(cfg.drafters)
    check(bool(names), "drafters", "empty; list at least one drafter of conf/drafter/ (e.g. [dflash])")
    check(len(set(names)) == len(names), "drafters", f"{names} lists a drafter twice")
    folder = Path(conf_dir) / "drafter"
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    out: dict[str, Any] = {}
    for name in names:
        if name not in known:
            raise ConfigError(f"drafters: {name!r} has no file {folder / (name + '.yaml')} (known: {known})")
        if name == cfg.drafter.name:
            out[name] = cfg.drafter
            continue
        try:
            out[name] = OmegaConf.merge(OmegaConf.structured(DrafterConfig), group_option(folder, name))
        except Exception as exc:  # noqa: BLE001 — a Hydra / OmegaConf error: name the file
            raise ConfigError(f"{folder / (name + '.yaml')}: {' '.join(str(exc).split())}") from None
    return out


def group_option(folder: Path, name: str) -> dict[str, Any]:
    """conf/drafter/<name>.yaml as Hydra composes the group option (its own `defaults` list, e.g. another drafter
    it extends, merged first), untyped. Called where no other Hydra composition is in progress."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(folder.parent.resolve()), version_base="1.3"):
        composed = compose(config_name=None, overrides=[f"+drafter={name}"])
    return OmegaConf.to_container(composed.drafter, resolve=False)  # type: ignore[return-value]


def needs_last_layer(cfg: Any, conf_dir: str | Path | None = None) -> bool:
    """Whether extract stores the target's final-normed last layer: a listed drafter whose type reads it
    (DSpark; a trained MTP head, i.e. a target without MTP layers), a distribution term (kl / tv) or
    acceptance weighting in any listed drafter's objective. `cfg` is the root config."""
    if conf_dir is None:
        from draftforge.paths import CONF_DIR

        conf_dir = CONF_DIR
    for d in listed_drafters(cfg, conf_dir).values():
        w = effective_loss_weights(d)
        if type_of(d).reads_last_layer(d, cfg.target) or w.get("kl", 0) > 0 or w.get("tv", 0) > 0 or d.acceptance_weighting:
            return True
    return False
