"""Export/load the drafter in the layout vLLM's `dflash` (a DSpark drafter: `dspark`) method loads (docs/architecture.md, "Drafter and training objective").

vLLM (model_executor/models/qwen3_dflash.py, DFlashQwen3ForCausalLM.load_weights) prefixes every
checkpoint name with `model.`, folds q/k/v into qkv_proj and gate/up into gate_up_proj, takes
`embed_tokens` and `lm_head` from the target when the checkpoint has none, and reads the context
taps from `dflash_config.target_layer_ids` (+1 internally). So the checkpoint holds exactly:
    fc.weight, hidden_norm.weight, norm.weight, layers.{i}.{input_layernorm, post_attention_layernorm,
    self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight
No `model.` prefix, no embeddings / LM head, no eagle_config. A DSpark drafter adds
    markov_head.markov_w{1,2}.weight (V, r) and confidence_head.proj.{weight (1, H[+r]), bias (1,)}
which vLLM's Qwen3DSparkForCausalLM.load_weights prefixes with `model.` the same way. A drafter with a draft
vocabulary of D tokens (docs/architecture.md, "Draft vocabulary") adds what vLLM loads for one, unprefixed:
    lm_head.weight (D, H)   the draft head (the model's `draft_head` buffer: the target's rows of those tokens)
    d2t (D,) int64          offsets: draft row i drafts target token i + d2t[i] (the model keeps the ids, `draft_ids`)
and config.json's `draft_vocab_size` = D.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from draftforge.drafter.config import CHECKSUM_KEY, DFlashConfig, config_checksum, read_exported_config
from draftforge.drafter.model import DFlashDrafter
from draftforge.drafter.registry import exported_type, model_class
from draftforge.errors import StageError
from draftforge.io import atomic_dir

LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# Names vLLM's loader would treat as something other than draft-layer weights (or reject); a draft vocabulary's
# two names (DRAFT_VOCAB_NAMES) are the exception its loader expects.
FORBIDDEN_SUBSTRINGS = ("embed_tokens", "lm_head", "model.", "mask_hidden", "d2t", "t2d", "midlayer")
# A draft vocabulary's buffers (drafter/model.py) → their exported names.
DRAFT_VOCAB_NAMES = {"draft_head": "lm_head.weight", "draft_ids": "d2t"}


def expected_keys(cfg: DFlashConfig) -> set[str]:
    """Every tensor vLLM's DFlashQwen3Model (Qwen3DSparkModel for a DSpark config) consumes for this shape
    (embeddings/LM head come from the target)."""
    return set(expected_shapes(cfg))


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }
    shapes = {"fc.weight": (H, cfg.feature_dim), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    shapes.update({f"layers.{i}.{k}": s for i in range(cfg.num_hidden_layers) for k, s in per_layer.items()})
    shapes.update(cfg.head_shapes())  # a DSpark drafter's heads
    if cfg.draft_vocab_size:
        shapes.update({"lm_head.weight": (cfg.draft_vocab_size, H), "d2t": (cfg.draft_vocab_size,)})
    return shapes


def exported_tensors(model: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state under vLLM's names, weights in `dtype`; a draft vocabulary's ids as vLLM's offsets."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "draft_ids":
            out["d2t"] = (t - torch.arange(t.shape[0], device=t.device)).to("cpu", torch.int64).contiguous()
        else:
            out[DRAFT_VOCAB_NAMES.get(name, name)] = t.detach().to("cpu", dtype).contiguous()
    return out


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """exported_tensors' inverse: vLLM's names → the model's state dict."""
    own = {v: k for k, v in DRAFT_VOCAB_NAMES.items()}
    out = {own.get(name, name): t for name, t in tensors.items()}
    if "draft_ids" in out:
        d2t = out["draft_ids"]
        out["draft_ids"] = d2t.to(torch.int64) + torch.arange(d2t.shape[0])
    return out


def check_keys(tensors: dict[str, torch.Tensor], cfg: DFlashConfig, where: str = "drafter") -> None:
    """Exported names == what vLLM consumes, shapes included; raise StageError naming the difference."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    allowed = set(DRAFT_VOCAB_NAMES.values()) if cfg.draft_vocab_size else set()
    bad = [n for n in tensors if n not in allowed and any(s in n for s in FORBIDDEN_SUBSTRINGS)]
    wrong = [f"{n} {tuple(t.shape)} != {want[n]}" for n, t in tensors.items() if n in want and tuple(t.shape) != want[n]]
    problems = []
    if missing:
        problems.append(f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}")
    if extra:
        problems.append(f"unexpected (vLLM would not consume) {extra[:6]}")
    if bad:
        problems.append(f"forbidden names {bad[:6]}")
    if wrong:
        problems.append(f"wrong shapes {wrong[:4]}")
    if problems:
        owner = exported_type(cfg.ARCHITECTURE)
        loader = owner.chain_method if owner else cfg.ARCHITECTURE
        raise StageError(f"{where}: key check against vLLM's {loader} loader failed: " + "; ".join(problems))


def export_drafter(model: DFlashDrafter, cfg: DFlashConfig, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> Path:
    """Write out_dir/{config.json, model.safetensors} atomically (the whole folder appears at once); config.json
    records its own checksum (drafter.config.config_checksum), which every reader of the export verifies."""
    tensors = exported_tensors(model, dtype)
    cfg = cfg.as_exported(str(out_dir))  # a rank-0 DSpark drafter exports as DFlash
    check_keys(tensors, cfg, where=str(out_dir))
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf.update(extra_config or {})
    if "eagle_config" in hf:
        raise StageError(f"{out_dir}: config.json must not carry an eagle_config (vLLM would read it as EAGLE)")
    hf = json.loads(json.dumps(hf))  # the checksum is of exactly what a reader will parse
    hf["draftforge"] = {**(hf.get("draftforge") or {}), CHECKSUM_KEY: config_checksum(hf)}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return Path(out_dir)


def unreadable_weights(path: str | Path, exc: BaseException) -> StageError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return StageError(f"{path}: not a readable safetensors file ({first}); it is truncated or corrupt: restore it, or "
                      "rerun the stage that wrote it")


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a truncated or corrupt file is one StageError naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise unreadable_weights(path, exc) from None


@contextlib.contextmanager
def open_weights(path: str | Path) -> Iterator[Any]:
    """`safe_open` of one safetensors file (lazy reads); a truncated or corrupt file is one StageError naming it."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            yield fh
    except SafetensorError as exc:
        raise unreadable_weights(path, exc) from None


def load_drafter(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", attn_impl: str = "auto") -> DFlashDrafter:
    """Load an exported drafter (our engine); validates config and keys with clear errors."""
    directory = Path(directory)
    cfg, weights = read_exported_config(directory), directory / "model.safetensors"
    tensors = load_weights(weights)
    check_keys(tensors, cfg, where=str(weights))
    model = model_class(cfg.ARCHITECTURE)(cfg, attn_impl=attn_impl)  # the model of the type owning this format
    model.load_state_dict(model_state(tensors), strict=True)
    return model.to(device=device, dtype=dtype).eval()
