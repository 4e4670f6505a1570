"""DFlashConfig: the drafter's shape, built from target.json + the `drafter` section, round-tripped through HF config.json.

One drafter config type: `drafter.settings.DrafterConfig` (the Hydra group) holds the shape's defaults, and
`DFlashConfig.from_target(info, shape)` is the one place a model config is derived from it (a subclass adds
its own section fields through `shape_fields`); the defaults below are DrafterConfig's, never restated.

Invariants: same width as the target (hidden, heads, KV heads, head_dim, MLP); `target_layer_ids` are
0-based "output of decoder layer i" (HF hidden_states[i+1]; vLLM adds 1 itself); the mask token is a
row of the target's embedding table (the vocabulary is never resized).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from draftforge.drafter.registry import export_config_class
from draftforge.drafter.settings import DrafterConfig as Shape
from draftforge.drafter.types.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from draftforge.errors import StageError

log = logging.getLogger(__name__)

HF_ARCHITECTURE = DFLASH_ARCHITECTURE
HF_MODEL_TYPE = "qwen3"
FULL, SLIDING = "full_attention", "sliding_attention"
# How each layer type attends inside the draft block; vLLM's dflash loader applies the same rule when
# `is_causal` and `dflash_config.causal` are unset, which is how draftforge exports.
ATTENTION_RULE = ("full_attention: bidirectional inside the block; sliding_attention: causal inside the block "
                  "and windowed (query at position p sees keys at positions > p - sliding_window)")


@dataclass
class DFlashConfig:
    ARCHITECTURE: ClassVar[str] = HF_ARCHITECTURE  # config.json `architectures[0]` of this format
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    block_size: int = Shape.block_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    target_num_layers: int = 0  # layer count of the target the taps index into
    target_hidden_size: int = 0  # 0 → hidden_size (same width as the target)
    sliding_window: int = Shape.sliding_window  # > 0: window of the sliding_attention layers
    # Per layer: full_attention | sliding_attention; empty → all full, or with a window the published
    # Qwen3.6-27B layout (sliding for every layer but the last).
    layer_types: list[str] = field(default_factory=list)
    # > 0: the drafter drafts from these many target tokens (its `draft_ids` buffer, chosen by train), 0: from
    # the whole vocabulary (docs/architecture.md, "Draft vocabulary").
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(t) for t in self.target_layer_ids]
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        if not self.layer_types:
            n = self.num_hidden_layers
            self.layer_types = [FULL] * n if self.sliding_window <= 0 else [SLIDING] * (n - 1) + [FULL]
        self.layer_types = [str(t) for t in self.layer_types]
        problems = []
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {FULL, SLIDING}:
            problems.append(f"layer_types {self.layer_types} must list {FULL!r}/{SLIDING!r} for each of "
                            f"{self.num_hidden_layers} layers")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            problems.append(f"sliding_window {self.sliding_window} must be > 0 with sliding_attention layers")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})")
        if not 0 <= self.draft_vocab_size < self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} must be in [0, vocab_size {self.vocab_size}) "
                            "(0: the whole vocabulary)")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} < 2")
        if self.target_num_layers and any(not 0 <= t < self.target_num_layers for t in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} outside [0, {self.target_num_layers - 1}]")
        if problems:
            raise StageError("drafter config: " + "; ".join(problems))

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def first_slot(self) -> int:
        """The first block slot that predicts a token: 1 in DFlash's fill-in block (slot 0 is the bonus)."""
        return 1

    @property
    def pred_offset(self) -> int:
        """Slot k predicts the token at anchor + k + pred_offset (the fill-in block: anchor + k)."""
        return 0

    @property
    def n_draft(self) -> int:
        """Drafts per block pass: the predicting slots first_slot..block_size−1."""
        return self.block_size - self.first_slot

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated tapped features fed to `fc`."""
        return self.n_taps * self.target_hidden_size

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensors beyond the DFlash backbone (a subclass's heads) → shape, as vLLM's loader consumes them."""
        return {}

    def as_exported(self, where: str) -> "DFlashConfig":
        """The config the export writes (a subclass may export in the plain DFlash format)."""
        return self

    @classmethod
    def shape_fields(cls, shape: Any) -> dict[str, Any]:
        """This config's fields taken from the `drafter` section (drafter.settings.DrafterConfig)."""
        return {"num_hidden_layers": int(shape.num_layers), "block_size": int(shape.block_size),
                "sliding_window": int(shape.sliding_window or 0),
                "draft_vocab_size": int(shape.draft_vocab_size)}

    @classmethod
    def from_target(cls, target_info: dict[str, Any], shape: Any, **overrides: Any) -> "DFlashConfig":
        """The drafter for a target.json record: width, taps and mask token from the target, the rest from
        `shape` (the `drafter` config section, `shape_fields`)."""
        try:
            fixed = target_info["drafter"]  # what the target fixes for every drafter
            values = dict(
                hidden_size=int(target_info["hidden_size"]),
                intermediate_size=int(target_info["intermediate_size"]),
                num_attention_heads=int(target_info["num_heads"]),
                num_key_value_heads=int(target_info["num_kv_heads"]),
                head_dim=int(target_info["head_dim"]),
                vocab_size=int(target_info["vocab_size"]),
                mask_token_id=int(fixed["mask_token_id"]),
                target_layer_ids=[int(t) for t in fixed["target_layer_ids"]],
                rms_norm_eps=float(target_info.get("rms_norm_eps", 1e-6)),
                rope_theta=float(target_info.get("rope_theta", 10000.0)),
                max_position_embeddings=int(target_info.get("max_position_embeddings", 4096)),
                target_num_layers=int(target_info["num_layers"]),
                **cls.shape_fields(shape),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StageError(f"target.json: missing or bad key for the drafter ({exc!r})") from None
        values.update(overrides)
        return cls(**values)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as vLLM's `dflash` method loads it (Qwen3 draft layers, full or sliding attention)."""
        return {
            "architectures": [HF_ARCHITECTURE],
            "model_type": HF_MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "use_sliding_window": SLIDING in self.layer_types,
            "sliding_window": self.sliding_window or None,
            "draftforge_attention_rule": ATTENTION_RULE,
            "block_size": self.block_size,
            "num_target_layers": self.target_num_layers,
            "target_hidden_size": self.target_hidden_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "torch_dtype": "bfloat16",
            # vLLM: a draft LM head of this many rows, its row i drafting target token i + d2t[i]
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}),
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], where: str = "config.json") -> "DFlashConfig":
        if hf.get("architectures") != [HF_ARCHITECTURE]:
            raise StageError(f"{where}: architectures {hf.get('architectures')} is not [{HF_ARCHITECTURE!r}]")
        dflash = hf.get("dflash_config") or {}
        try:
            rope = hf.get("rope_parameters") or {}
            return cls(
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=int(hf["num_attention_heads"]),
                num_key_value_heads=int(hf["num_key_value_heads"]),
                head_dim=int(hf["head_dim"]),
                vocab_size=int(hf["vocab_size"]),
                mask_token_id=int(dflash["mask_token_id"]),
                target_layer_ids=[int(t) for t in dflash["target_layer_ids"]],
                block_size=int(hf.get("block_size", Shape.block_size)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                target_num_layers=int(hf.get("num_target_layers", 0)),
                target_hidden_size=int(hf.get("target_hidden_size", 0)),
                sliding_window=int(hf.get("sliding_window") or 0),
                layer_types=list(hf.get("layer_types") or []),
                draft_vocab_size=_draft_vocab(hf),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StageError(f"{where}: missing or bad key ({exc!r})") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["draft_vocab_size"]:  # a field added at its default: records made before it (resume keys) stay equal
            del d["draft_vocab_size"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _draft_vocab(hf: dict[str, Any]) -> int:
    """config.json's `draft_vocab_size` as DFlashConfig holds it: 0 when absent or the whole vocabulary."""
    d = hf.get("draft_vocab_size")
    return 0 if d is None or int(d) == int(hf["vocab_size"]) else int(d)


# The export records a checksum of its config.json inside the file itself (vLLM and HF ignore the unknown
# `draftforge` block, so the folder stays loadable as is): sha256 of the canonical JSON (sorted keys, no
# whitespace) of every key but this one. Formatting changes keep it; any value change breaks it.
CHECKSUM_KEY = "config_sha256"


def config_checksum(hf: dict[str, Any]) -> str:
    """The checksum of a drafter config.json's content, its own `draftforge.config_sha256` left out."""
    content = dict(hf)
    if isinstance(content.get("draftforge"), dict):
        meta = {k: v for k, v in content["draftforge"].items() if k != CHECKSUM_KEY}
        content.pop("draftforge")
        if meta:  # a block that held only the checksum was absent when it was computed
            content["draftforge"] = meta
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_config_checksum(hf: dict[str, Any], cfg_path: Path) -> None:
    """Refuse a config.json edited after export (block_size, taps, ... no longer what the weights were trained
    with). A config without a recorded checksum (exported elsewhere, or by draftforge before checksums) is
    used as is: nothing records what it said at export."""
    meta = hf.get("draftforge") if isinstance(hf.get("draftforge"), dict) else {}
    recorded = meta.get(CHECKSUM_KEY)
    if recorded is None:
        if meta:
            log.warning("%s: no draftforge.%s (exported before config checksums): edits to it cannot be detected; "
                        "rerun train to re-export it", cfg_path, CHECKSUM_KEY)
        return
    if str(recorded) != config_checksum(hf):
        raise StageError(f"{cfg_path}: edited after export (its content no longer matches draftforge.{CHECKSUM_KEY}, "
                         "so it may not describe the trained weights); restore it, or retrain / re-export the drafter "
                         "(snakemake --forcerun train) to change its config")


def read_exported_config(directory: str | Path) -> DFlashConfig:
    """The config of an exported drafter folder (config.json + model.safetensors), with clear errors; a
    config.json edited after export is refused (check_config_checksum)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file() or not (directory / "model.safetensors").is_file():
        raise StageError(f"{directory}: not an exported drafter (needs config.json + model.safetensors)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise StageError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise StageError(f"{cfg_path}: not a JSON object; restore it, or rerun train to re-export the drafter")
    check_config_checksum(hf, cfg_path)
    archs = hf.get("architectures")
    # The drafter type owning this export format (drafter/registry.py) names its config class; a folder of no
    # registered format is read as DFlash, whose from_hf_dict names the architecture it expected.
    owner = export_config_class(archs[0]) if isinstance(archs, list) and len(archs) == 1 else None
    return (owner or DFlashConfig).from_hf_dict(hf, where=str(cfg_path))


def check_drafter_target(directory: str | Path, target_info: dict[str, Any]) -> None:
    """Refuse a drafter trained for another target: its config.json's `draftforge.target_fingerprint`
    (written at export) must equal the target's fingerprint. A drafter exported elsewhere carries no
    fingerprint: it is used with a warning (only its shape can be checked)."""
    cfg_path = Path(directory) / "config.json"
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(f"{cfg_path}: unreadable drafter config ({exc})") from None
    if not isinstance(hf, dict):
        raise StageError(f"{cfg_path}: not a JSON object; restore it, or rerun train to re-export the drafter")
    check_config_checksum(hf, cfg_path)  # an edited fingerprint is an edit like any other
    meta = hf.get("draftforge") if isinstance(hf.get("draftforge"), dict) else {}
    recorded, want = meta.get("target_fingerprint"), str(target_info.get("fingerprint"))
    if recorded is None:
        log.warning("%s: no draftforge.target_fingerprint (not exported by draftforge): cannot check that it was "
                    "trained for target %s; only its shape is checked", cfg_path, target_info.get("name"))
        return
    if str(recorded) != want:
        raise StageError(
            f"{cfg_path}: drafter trained for another target (draftforge.target_fingerprint {str(recorded)[:12]}, "
            f"target {meta.get('target', '?')!r}) but the target is {target_info.get('name')!r} "
            f"(fingerprint {want[:12]}); retrain it (snakemake --forcerun train) or point to a drafter of this target"
        )
