"""`target` stage: resolve the target spec to a loadable HF folder and write target.json."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftforge.errors import StageError
from draftforge.io import atomic_dir, build_lock, sha256_json, write_json
from draftforge.paths import cache_dir
from draftforge.target.config import default_tap_ids
from draftforge.target.info import DrafterInputs, TargetInfo
from draftforge.target.inspect import describe, fingerprint

log = logging.getLogger(__name__)


def _plain(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def _random_folder(spec: dict[str, Any], cache_root: Path) -> Path:
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import save_random_target

    final = cache_root / "targets" / f"random-{sha256_json(spec)[:16]}"
    if not (final / "config.json").is_file():
        with build_lock(final):
            if not (final / "config.json").is_file():
                with atomic_dir(final) as tmp:
                    save_random_target(RandomTargetConfig(**spec), tmp)
    return final


def _hub_cache_folder(hub_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise StageError(
            f"target.hub_id={hub_id!r}: not in the local HF cache ({type(exc).__name__}); draftforge never "
            "downloads at run time: fetch it beforehand (`hf download ...`) or set target.source=hf_dir target.path=DIR"
        ) from None


def resolve_folder(target: dict[str, Any], results_root: Path) -> Path:
    source = target["source"]
    if source == "hf_dir":
        if not target.get("path"):
            raise StageError("target.path: required when target.source=hf_dir")
        folder = Path(os.path.expanduser(target["path"])).resolve()
        if not folder.is_dir():
            raise StageError(f"target.path={target['path']!r}: no such directory")
        return folder
    if source == "hub_cache":
        if not target.get("hub_id"):
            raise StageError("target.hub_id: required when target.source=hub_cache")
        return _hub_cache_folder(target["hub_id"], target.get("revision"))
    if source == "gguf_package":
        from draftforge.target.gguf import convert_gguf, locate_package_file

        if not (target.get("package") and target.get("gguf_file")):
            raise StageError("target.package and target.gguf_file: both required when target.source=gguf_package")
        gguf_path = locate_package_file(target["package"], target["gguf_file"])
        return convert_gguf(gguf_path, cache_dir(results_root), target["name"])
    if source == "random":
        if not target.get("random"):
            raise StageError("target.random: required when target.source=random")
        return _random_folder(target["random"], cache_dir(results_root))
    raise StageError(f"target.source={source!r}: unknown")


def drafter_inputs(target: dict[str, Any], num_layers: int, vocab_size: int) -> DrafterInputs:
    shape = dict(target["drafter"])
    taps = shape.get("target_layer_ids") or default_tap_ids(num_layers, int(shape["n_taps"]))
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise StageError(f"target.drafter.target_layer_ids: {bad} outside [0, {num_layers - 1}] for a {num_layers}-layer target")
    if not 0 <= int(shape["mask_token_id"]) < vocab_size:
        raise StageError(f"target.drafter.mask_token_id={shape['mask_token_id']}: outside the vocabulary (size {vocab_size})")
    shape["target_layer_ids"] = [int(t) for t in taps]
    shape["n_taps"] = len(taps)
    return shape


def resolve_target(target_cfg: DictConfig | dict[str, Any], results_root: str | Path) -> TargetInfo:
    """The target.json record for a target spec (converts/builds the folder when needed)."""
    target = _plain(target_cfg)
    folder = resolve_folder(target, Path(results_root))
    facts = describe(folder)
    if target.get("architecture") and target["architecture"] != facts["architecture"]:
        raise StageError(f"target.architecture={target['architecture']!r}, but {folder}/config.json says {facts['architecture']!r}")
    if target.get("num_layers") and int(target["num_layers"]) != facts["num_layers"]:
        raise StageError(f"target.num_layers={target['num_layers']}, but {folder}/config.json has {facts['num_layers']} layers")
    if not facts["chat_template"]:
        raise StageError(f"{folder}: no chat template (tokenizer_config.json or chat_template.jinja): curate cannot render chats")
    return {
        "name": target["name"],
        "source": target["source"],
        "hf_path": str(folder),
        **facts,
        "dtype": target["dtype"],
        "fingerprint": fingerprint(folder),
        "drafter": drafter_inputs(target, facts["num_layers"], facts["vocab_size"]),
    }


def main(ctx) -> None:
    from draftforge.tracking import mlflow_run

    info = resolve_target(ctx.cfg.target, ctx.results_root)
    with mlflow_run(**ctx.tracking_kwargs(), run_name=f"target/{info['name']}", params=ctx.params) as run:
        run.log_params({"resolved": {k: v for k, v in info.items() if k != "drafter"}, "drafter": info["drafter"]})
        run.log_metrics({"num_layers": info["num_layers"], "hidden_size": info["hidden_size"], "vocab_size": info["vocab_size"]})
        write_json(ctx.out_dir / "target.json", info)
        run.log_artifact(ctx.out_dir / "target.json")
    log.info("target %s: %s (%d layers, H %d) fingerprint %s", info["name"], info["hf_path"], info["num_layers"], info["hidden_size"], info["fingerprint"][:12])
