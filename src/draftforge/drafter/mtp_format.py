"""Torch-free facts of the MTP head's serving format (docs/architecture.md, "MTP head").

A trained head is exported as a MiMo MTP checkpoint (config.json with architectures
["MiMoForCausalLM"], num_nextn_predict_layers 1; tensors model.mtp_layers.0.*, plus the target's
embedding and LM head) and served by vLLM with speculative_config `{method: mtp, model: <dir>}`.
vLLM builds MTP draft models from the *target's* config (MTP layers normally ship inside the target's
checkpoint), so a target without MTP layers is also given `hf_overrides=MTP_TARGET_OVERRIDES`.
"""

MTP_TARGET_OVERRIDES = {"num_nextn_predict_layers": 1}
TRAINED_DEFAULT_DRAFTS = 3  # vLLM num_speculative_tokens for a trained head when not configured
HEAD_CONFIG = "mtp_head.json"  # our marker beside a trained head's export (form, source, training)
