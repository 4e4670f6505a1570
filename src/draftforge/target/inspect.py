"""Describe an HF model folder without loading weights: shape facts, MTP/hybrid markers, fingerprint.

Fingerprint = sha256 over config.json (canonical, without the keys its writer stamps), the weight index (tensor name, dtype, shape from
the safetensors headers) and, per weight file, its size and the hashes of its first/last 4 MiB; cheap
on 60 GB checkpoints, yet different seeds or a re-quantized file change it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from draftforge.errors import StageError

EDGE_BYTES = 4 << 20


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise StageError(f"{hf_dir}: not an HF model folder (config.json missing)")
    return read_json_file(path)


def read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StageError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}); re-save it as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise StageError(f"{path}: invalid JSON ({exc})") from None


def safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                raise ValueError("header length implausible")
            header = json.loads(fh.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise StageError(f"{path}: unreadable safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    return header


def weight_files(hf_dir: Path) -> list[Path]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise StageError(f"{hf_dir}: no *.safetensors weight files (convert .bin checkpoints first)")
    return files


def weight_index(hf_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """tensor name → (dtype, shape) over every safetensors file of the folder."""
    index: dict[str, tuple[str, list[int]]] = {}
    for path in weight_files(hf_dir):
        for name, meta in safetensors_header(path).items():
            index[name] = (meta["dtype"], list(meta["shape"]))
    return index


# config.json keys the writer stamps, not the model: the same GGUF converted by transformers 5.17 and 5.19 gives
# byte-identical weights and configs that differ only in transformers_version (docs/architecture.md).
WRITER_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


def fingerprint(hf_dir: Path, legacy: bool = False) -> str:
    """The folder's identity (module docstring); `legacy` also hashes the writer keys, as target.json files
    written before they were left out did (check_fingerprint accepts both)."""
    digest = hashlib.sha256()
    config = read_config(hf_dir)
    if not legacy:
        config = {k: v for k, v in config.items() if k not in WRITER_KEYS}
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(json.dumps(sorted(weight_index(hf_dir).items())).encode())
    for path in weight_files(hf_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as fh:
            digest.update(fh.read(EDGE_BYTES))
            fh.seek(max(0, size - EDGE_BYTES))
            digest.update(fh.read(EDGE_BYTES))
    return digest.hexdigest()


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Qwen3.5/3.6) keep the LM shape under text_config."""
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


def count_mtp_layers(config: dict[str, Any], names: list[str]) -> int:
    text = _text_config(config)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        if int(text.get(key) or config.get(key) or 0) > 0:
            return int(text.get(key) or config.get(key))
    layer_ids = {n.split(".")[2] for n in names if n.startswith(("model.mtp_layers.", "mtp.layers."))}
    return len(layer_ids)


def is_hybrid(config: dict[str, Any]) -> bool:
    text = _text_config(config)
    return any(t != "full_attention" and "sliding" not in t for t in text.get("layer_types") or [])


def has_chat_template(hf_dir: Path) -> bool:
    if (hf_dir / "chat_template.jinja").is_file() or (hf_dir / "chat_template.json").is_file():
        return True
    tok_cfg = hf_dir / "tokenizer_config.json"
    return tok_cfg.is_file() and bool(read_json_file(tok_cfg).get("chat_template"))


def describe(hf_dir: Path) -> dict[str, Any]:
    """Shape facts of the folder's language model, as target.json records them."""
    config = read_config(hf_dir)
    text = _text_config(config)
    names = list(weight_index(hf_dir))
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    rope = text.get("rope_parameters") or {}
    return {
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type", "?"),
        "num_layers": int(text["num_hidden_layers"]),
        "hidden_size": hidden,
        "intermediate_size": int(text.get("intermediate_size") or 0),
        "num_heads": heads,
        "num_kv_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or hidden // heads),
        "vocab_size": int(text["vocab_size"]),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        "max_position_embeddings": int(text.get("max_position_embeddings") or 4096),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        "weights_dtype": str(text.get("dtype") or config.get("torch_dtype") or "?"),
        "eos_token_ids": [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])],
        "pad_token_id": text.get("pad_token_id"),
        "mtp_layers": count_mtp_layers(config, names),
        "hybrid_attention": is_hybrid(config),
        "chat_template": has_chat_template(hf_dir),
    }
