"""Readers of target.json used by every downstream stage: validate, then load model or tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftforge.errors import StageError
from draftforge.io import read_json
from draftforge.target.info import REQUIRED_KEYS, TargetInfo


def read_target_info(path: str | Path) -> TargetInfo:
    """target.json as a dict; a clear error if it is missing, malformed or points nowhere."""
    path = Path(path)
    if path.is_dir():
        path = path / "target.json"
    info = read_json(path, what="target.json")
    missing = [k for k in REQUIRED_KEYS if k not in info]
    if missing:
        raise StageError(f"{path}: target.json lacks {missing}; rerun the `target` stage")
    if not Path(info["hf_path"]).is_dir():
        raise StageError(f"{path}: hf_path {info['hf_path']} does not exist; rerun the `target` stage")
    return info  # type: ignore[return-value]


def check_fingerprint(info: dict[str, Any]) -> None:
    """Refuse a folder whose weights changed since target.json was written."""
    from draftforge.target.inspect import fingerprint

    now = fingerprint(Path(info["hf_path"]))
    if now != info["fingerprint"] and fingerprint(Path(info["hf_path"]), legacy=True) != info["fingerprint"]:
        raise StageError(
            f"{info['hf_path']}: weights changed since target.json was written "
            f"(fingerprint {now[:12]} != {info['fingerprint'][:12]}); rerun the `target` stage"
        )


def load_target_model(info: dict[str, Any], dtype: Any = None, device: str = "cpu", verify: bool = True):
    """The target as a frozen HF causal LM in eval mode (default dtype float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    if verify:
        check_fingerprint(info)
    dtype = dtype or torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(info["hf_path"], dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise StageError(f"{info['hf_path']}: could not load the target ({type(exc).__name__}: {exc})") from None
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(info: dict[str, Any]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info["hf_path"], local_files_only=True)
    if not tokenizer.chat_template:
        raise StageError(f"{info['hf_path']}: tokenizer has no chat template (needed to render conversations)")
    return tokenizer
