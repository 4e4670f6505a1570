"""Capture the tapped layers of a HF decoder with forward hooks; stop after the last tap.

Convention (docs/architecture.md, "Layer taps"): layer id L = output of decoder layer L (0-based) = HF
`hidden_states[L + 1]` (index 0 is the embeddings). The full tuple of all layers is never built:
a hook on each tapped layer keeps only the non-padding rows, and the hook of the last tap raises a
private exception so later layers, the final norm and the LM head never run.
One caveat: for the LAST decoder layer HF's tuple holds the final-normed state (transformers ties
hidden_states[-1] to last_hidden_state); a tap there is the raw layer output. Default taps stop at L-3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class _StopForward(Exception):
    """Raised from the last tapped layer's hook to end the forward early (never escapes this module)."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a HF causal LM or its base model (Llama/Qwen-style `model.layers`)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layer list at .model.layers")
    return layers


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (HF `model.model`); the model itself if it is one."""
    return model.model if hasattr(model, "model") and hasattr(model, "lm_head") else model


class TapCapture:
    """Forward hooks on the tapped decoder layers; `run` returns the packed tapped states.

    For one forward over (B, T) ids with a (B, T) 0/1 mask, `run` returns (N, n_taps·H) where
    N = mask.sum() and rows are the valid tokens in row-major order (batch row, then position).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], stop_after_last: bool = True,
                 capture_last: bool = False) -> None:
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside [0, {len(layers)}) decoder layers")
        if sorted(set(layer_ids)) != list(layer_ids):
            raise ValueError(f"target_layer_ids {layer_ids} must be strictly increasing")
        self.model = base_model(model)
        self.layers = layers
        self.layer_ids = list(layer_ids)
        # capture_last: also keep the final-normed last-layer state (the base model's `norm` output, the
        # LM head's input): the forward then runs every layer (no early stop) but never the LM head.
        self.capture_last = capture_last
        self.stop_after_last = stop_after_last and not capture_last
        self.last_out: torch.Tensor | None = None  # (N, H) after run() when capture_last
        self._valid: torch.Tensor | None = None  # (N,) flat indices of valid tokens in B·T, set during run()
        self._out: list[torch.Tensor] = []

    def _hook(self, tap: int):
        last = tap == len(self.layer_ids) - 1

        def hook(module: nn.Module, args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output  # (B, T, H)
            # (N, H): padding rows dropped here; index_select needs no host sync (boolean masks do)
            self._out.append(hidden.flatten(0, 1).index_select(0, self._valid))
            if last and self.stop_after_last:
                raise _StopForward

        return hook

    def _last_hook(self, module: nn.Module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        self.last_out = hidden.flatten(0, 1).index_select(0, self._valid)

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        handles = [self.layers[i].register_forward_hook(self._hook(k)) for k, i in enumerate(self.layer_ids)]
        if self.capture_last:
            norm = getattr(self.model, "norm", None)
            if not isinstance(norm, nn.Module):
                raise TypeError(f"{type(self.model).__name__}: no final norm at .norm to capture the last layer from")
            handles.append(norm.register_forward_hook(self._last_hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, valid_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids (B, T) long, attention_mask (B, T) 0/1 with right padding → (N, n_taps·H).

        valid_index (N,) long: flat positions of the mask's ones (computed on the host by the batcher
        to avoid a device sync); derived from the mask when omitted.
        """
        if valid_index is None:
            valid_index = attention_mask.flatten().nonzero().squeeze(1)
        self._valid = valid_index
        self._out = []
        self.last_out = None
        try:
            with self._hooks():
                self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._valid = None
        if len(self._out) != len(self.layer_ids):
            raise RuntimeError(f"captured {len(self._out)} of {len(self.layer_ids)} tapped layers")
        if self.capture_last and self.last_out is None:
            raise RuntimeError("the final norm did not run: no last-layer states captured")
        out, self._out = torch.cat(self._out, dim=-1), []  # (N, n_taps·H)
        return out
