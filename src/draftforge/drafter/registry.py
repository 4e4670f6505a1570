"""Drafter types, each registered once (docs/architecture.md, "Drafter types"). Torch-free at import.

Every rule that differs between drafter types is a field of that type's `DrafterType` record, and the
stages ask the registry (`type_of(drafter_section)`, `drafter_type(name)`, `tree_methods()`,
`artifact_of_method(m)`, ...) instead of comparing type strings. A type is one module that calls
`register_drafter_type`: the built-in ones are the modules of `draftforge.drafter.types` (BUILTIN_MODULES),
a plugin type is any importable module named by its drafter file's `module:` key (`load_module`).

Invariants:
  - a type's engine methods are its chain method followed by its tree methods; `ar` is no type's method
    (every branch measures it as its speedup reference);
  - hooks that need torch (config / model classes of an export) are "module:attr" strings resolved on first
    use (`resolve`), so importing the registry (the Snakefile, config composition) never imports torch;
  - built-in modules load on the first lookup, in BUILTIN_MODULES order: that order is the order of
    `drafter_types()`, `tree_methods()` and `served_vllm_methods()`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from draftforge.errors import ConfigError

BUILTIN_MODULES = ("draftforge.drafter.types.dflash", "draftforge.drafter.types.dspark", "draftforge.drafter.types.mtp")
AR = "ar"  # the method without a drafter: every branch's speedup and lossless reference
# What a branch's train stage writes under train/<branch>/ and its evaluate / baselines load (also the key
# of its block in train's metrics.json): an exported block drafter (config.json + model.safetensors) or an
# MTP head (the target's own layer, or one trained in MiMo format).
BLOCK_DRAFTER, MTP_HEAD = "drafter", "mtp"
ARTIFACTS = (BLOCK_DRAFTER, MTP_HEAD)

# (drafter section, target section) → whether extract must store the target's final-normed last layer.
ReadsLastLayer = Callable[[Any, Any], bool]


def _never(drafter: Any, target: Any) -> bool:
    return False


@dataclass(frozen=True)
class DrafterType:
    name: str  # the `drafter.type` value of its drafter files
    title: str  # display name ("DFlash", "DSpark", "MTP head")
    chain_method: str  # engine method drafting one chain; vLLM serves the same name (the parity pair)
    tree_methods: tuple[str, ...] = ()  # engine methods swept over evaluate.budgets (tree drafts)
    # vLLM methods of the branch besides `ar`: those it serves from its own artifact (keys of vllm_planners)
    # and drafter-free ones that ride with the branch (ngram, eagle3 ride with dflash).
    vllm_methods: tuple[str, ...] = ()
    # vLLM method → "module:function"(mcfg, target_info, artifact_dir, device) -> baselines.spec.MethodPlan.
    vllm_planners: Mapping[str, str] = field(default_factory=dict)
    default_loss_weights: Mapping[str, float] = field(default_factory=lambda: {"ce": 1.0})
    reads_last_layer: ReadsLastLayer = _never  # beyond what its objective weights read (kl / tv)
    artifact: str = BLOCK_DRAFTER
    # HF `architectures[0]` of the exports this type owns → "module:Class" of their config
    # (a `from_hf_dict` classmethod); a type that exports in another type's format owns none.
    exports: Mapping[str, str] = field(default_factory=dict)
    # "module:Class" of the torch model built from each owned config (same keys as `exports`).
    models: Mapping[str, str] = field(default_factory=dict)
    # "module:Class" of the model config train builds for this type (`Class.from_target(target_info, drafter
    # section)`, docs/architecture.md "Drafter branches"); None for a type without a block drafter.
    model_config: Optional[str] = None
    # "module:function"(ctx, train cfg, target info, free_bytes) -> train.branch.Branch: how its branch trains
    # (the block drafters' loop task by default; the MTP head its own task through the same loop).
    train_branch: str = "draftforge.train.stage:block_branch"
    # Row key naming whose weights ran its chain ("mtp_source": native / trained); labels read "method (source)".
    source_key: Optional[str] = None
    # The report compares the best tree method against this type's chain (the "DDTree vs MTP" table).
    tree_reference: bool = False
    # Dotted config keys its branches never read: left out of their stage params, so changing one reruns only
    # the branches that read it. Listing none is safe (every change reruns the branch); a key listed here but
    # read after all would be a stale result, so list only what the type's code provably ignores. The tree
    # keys (TREE_KEYS) are left out for a type without tree methods.
    ignores: tuple[str, ...] = ()
    # Whether its drafters may draft from a subset of the vocabulary (drafter.draft_vocab_size > 0).
    draft_vocab: bool = False
    module: str = ""  # the module that registered it (set by register_drafter_type)

    def __post_init__(self) -> None:
        problems = []
        if self.artifact not in ARTIFACTS:
            problems.append(f"artifact {self.artifact!r} is not one of {list(ARTIFACTS)}")
        if AR in (self.chain_method, *self.tree_methods, *self.vllm_methods):
            problems.append(f"{AR!r} is every branch's reference, not a type's method")
        if set(self.vllm_planners) - set(self.vllm_methods):
            problems.append(f"vllm_planners {sorted(self.vllm_planners)} must be among vllm_methods {list(self.vllm_methods)}")
        if set(self.models) - set(self.exports):
            problems.append(f"models {sorted(self.models)} must be among exports {sorted(self.exports)}")
        if problems:
            raise ValueError(f"drafter type {self.name!r}: " + "; ".join(problems))

    @property
    def engine_methods(self) -> tuple[str, ...]:
        return (self.chain_method, *self.tree_methods)


_TYPES: dict[str, DrafterType] = {}
_LOADED: list[bool] = []  # non-empty once the built-in modules are imported


def register_drafter_type(factory: Callable[[], DrafterType]) -> Callable[[], DrafterType]:
    """Decorator of a type module's zero-argument function returning its DrafterType: registers the record
    (under the function's module) at import. The same name from two modules is an error; the same module
    registering again (imported afresh) replaces its record."""
    kind = factory()
    if not isinstance(kind, DrafterType):
        raise TypeError(f"{factory.__module__}.{factory.__name__} must return a DrafterType, not {type(kind).__name__}")
    kind = DrafterType(**{**kind.__dict__, "module": factory.__module__})
    old = _TYPES.get(kind.name)
    if old is not None and old.module != kind.module:
        raise ValueError(f"drafter type {kind.name!r} registered twice ({old.module} and {kind.module})")
    _TYPES[kind.name] = kind
    return factory


def _builtins() -> None:
    if not _LOADED:
        _LOADED.append(True)
        for name in BUILTIN_MODULES:
            importlib.import_module(name)


def load_module(module: str, key: str = "drafter.module") -> None:
    """Import a plugin type's module (it registers its types at import); one clear error when it fails."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module!r} ({exc}); put its package on PYTHONPATH") from None


def drafter_types() -> dict[str, DrafterType]:
    """name → type, every registered type (built-ins first, then plugins in import order)."""
    _builtins()
    plugins = len(BUILTIN_MODULES)  # built-ins in their fixed order whatever imported them first, then plugins
    rank = {name: (BUILTIN_MODULES.index(t.module) if t.module in BUILTIN_MODULES else plugins, i)
            for i, (name, t) in enumerate(_TYPES.items())}
    return {name: _TYPES[name] for name in sorted(_TYPES, key=rank.get)}


def drafter_type(name: str, key: str = "drafter.type") -> DrafterType:
    types = drafter_types()
    if name not in types:
        raise ConfigError(f"{key}: {name!r} is not a registered drafter type; use one of {list(types)} "
                          "(a plugin type: set drafter.module to the module that registers it)")
    return types[name]


def type_of(drafter: Any) -> DrafterType:
    """The type of a `drafter` section (DrafterConfig or its DictConfig), importing its plugin module first."""
    module = getattr(drafter, "module", "") or ""
    if module:
        load_module(str(module))
    return drafter_type(str(drafter.type))


# Read only by the tree methods (their budget sweep and the auto budget's calibration prompts).
TREE_KEYS: tuple[str, ...] = ("evaluate.budgets", "evaluate.calibration_prompts")


def ignored_keys(drafter: Any) -> tuple[str, ...]:
    """The dotted config keys a branch of this drafter section's type never reads (config.stage_params)."""
    kind = type_of(drafter)
    return kind.ignores + (() if kind.tree_methods else TREE_KEYS)


def _unique(items: Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def tree_methods() -> tuple[str, ...]:
    """Every type's tree methods (swept over evaluate.budgets), each once."""
    return _unique(m for t in drafter_types().values() for m in t.tree_methods)


def chain_methods() -> tuple[str, ...]:
    return _unique(t.chain_method for t in drafter_types().values())


def method_order() -> dict[str, int]:
    """Row order of a branch's engine methods: `ar`, the reference chains, the other chains, then the trees."""
    types = drafter_types().values()
    ref = [t.chain_method for t in types if t.tree_reference]
    return {m: i for i, m in enumerate(_unique([AR, *ref, *chain_methods(), *tree_methods()]))}


def reference_type() -> Optional[DrafterType]:
    """The type whose chain the report compares the best tree method against (None when none is registered)."""
    return next((t for t in drafter_types().values() if t.tree_reference), None)


def _owner(method: str, engine: bool = True) -> Optional[DrafterType]:
    for t in drafter_types().values():
        if method in (t.engine_methods if engine else t.vllm_planners):
            return t
    return None


def artifact_of_method(method: str) -> Optional[str]:
    """What an engine method drafts with (BLOCK_DRAFTER | MTP_HEAD), None for `ar` and unknown names. Every
    type listing a method agrees on it (a method runs on one kind of artifact)."""
    owner = _owner(method)
    return owner.artifact if owner else None


def artifact_of_vllm_method(method: str) -> Optional[str]:
    """The artifact a vLLM method serves from a branch's train output; None for drafter-free methods."""
    owner = _owner(method, engine=False)
    return owner.artifact if owner else None


def source_key_of_method(method: str) -> Optional[str]:
    """The row key naming whose weights ran `method` (engine or vLLM), None when the method has none."""
    owner = _owner(method) or _owner(method, engine=False)
    return owner.source_key if owner else None


def served_vllm_methods() -> tuple[str, ...]:
    """vLLM methods served from a trained artifact, in type order (dflash, dspark, mtp for the built-ins)."""
    return _unique(m for t in drafter_types().values() for m in t.vllm_planners)


def vllm_planner(method: str) -> Optional[Callable[..., Any]]:
    owner = _owner(method, engine=False)
    return resolve(owner.vllm_planners[method]) if owner else None


def resolve(ref: str) -> Any:
    """'package.module:attr' → the attribute (imports the module: the only place hooks get imported)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_model_config(drafter: Any, target_info: Mapping[str, Any]) -> Any:
    """The block drafter's model config of a `drafter` section on a target (DFlashConfig or a subclass)."""
    kind = type_of(drafter)
    if kind.model_config is None:
        raise ValueError(f"drafter type {kind.name!r} has no block drafter config")
    return resolve(kind.model_config).from_target(dict(target_info), drafter)


def export_config_class(architecture: Optional[str]) -> Optional[type]:
    """The config class of an exported folder whose config.json names `architecture` (None: no type owns it)."""
    for t in drafter_types().values():
        if architecture in t.exports:
            return resolve(t.exports[architecture])
    return None


def model_class(architecture: str) -> type:
    for t in drafter_types().values():
        if architecture in t.models:
            return resolve(t.models[architecture])
    raise ValueError(f"no drafter type builds a model for architecture {architecture!r}")


def exported_type(architecture: str) -> Optional[DrafterType]:
    """The type that owns exports of this architecture (a DFlash export is the dflash type's)."""
    return next((t for t in drafter_types().values() if architecture in t.exports), None)
