"""Random-weight targets built locally: a real HF model folder with a byte-level ChatML tokenizer.

Used by unit tests (tiny, seconds) and GPU benchmarks (Qwen3-8B-shaped) without any download.
Token ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, 3 <|mask|> (never emitted in chat),
4 <think>, 5 </think>, then 256 byte tokens; the rest of the vocabulary is unused rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftforge.target.config import RandomTargetConfig

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<think>", "</think>"]
RANDOM_MASK_TOKEN_ID = 3
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges: every UTF-8 byte is one token (lossless, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n_base = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_base:
        raise ValueError(f"random target vocab_size must be >= {n_base} (specials + 256 bytes)")
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


RANDOM_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


def _hybrid_config(spec: RandomTargetConfig, common: dict):
    """Qwen3.5 text / Qwen3-Next config: GDN layers with every `full_attention_interval`-th layer attention."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    layer_types = ["full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
                   for i in range(spec.num_layers)]
    hybrid = dict(
        common,
        layer_types=layer_types,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.partial_rotary_factor},
    )
    hybrid.pop("rope_theta")
    if spec.architecture == "Qwen3_5ForCausalLM":
        return Qwen3_5TextConfig(**hybrid)
    return Qwen3NextConfig(**hybrid, num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                           moe_intermediate_size=spec.moe_intermediate_size,
                           shared_expert_intermediate_size=spec.moe_intermediate_size)


def build_random_model(spec: RandomTargetConfig, dtype: torch.dtype = torch.float32):
    """An HF causal LM with seeded random weights (one of RANDOM_ARCHITECTURES)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-6,
    )
    if spec.architecture == "LlamaForCausalLM":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif spec.architecture == "Qwen3ForCausalLM":
        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif spec.architecture in ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"):
        from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

        config = _hybrid_config(spec, common)
        cls = Qwen3_5ForCausalLM if spec.architecture == "Qwen3_5ForCausalLM" else Qwen3NextForCausalLM
    else:
        raise ValueError(f"random target architecture {spec.architecture!r}: use one of {RANDOM_ARCHITECTURES}")
    torch.manual_seed(spec.seed)
    model = cls(config)
    # Larger-than-default init keeps logits far from uniform, so greedy ties are (almost) impossible.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.6 / param.shape[-1] ** 0.5 * 4)
    return model.to(dtype).eval()


def save_random_target(spec: RandomTargetConfig, out_dir: str | Path) -> Path:
    """Write model + tokenizer to out_dir (an HF folder loadable by transformers and vLLM)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_random_model(spec)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out_dir, safe_serialization=True)
    build_byte_tokenizer(spec.vocab_size).save_pretrained(out_dir)
    return out_dir
