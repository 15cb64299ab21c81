"""Transformer encoder layer and stack, numerically equal to nn.TransformerEncoderLayer/Encoder.

Every op except attention is per token, so one layer serves both (B, T, E) batches and packed
(N, E) varlen tokens: the caller passes the self-attention as a function of the layer input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from .attention import FusedAttention

AttnFn = Callable[[FusedAttention, Tensor], Tensor]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf), as nn.TransformerEncoderLayer and BERT's "gelu"
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # HF "gelu_new" / "gelu_pytorch_tanh"
}


class EncoderLayer:
    """One encoder layer: self-attention + feed-forward, post-norm or pre-norm (norm_first)."""

    def __init__(self, state: dict[str, Tensor], config: dict, prefix: str) -> None:
        E = int(config["d_model"])
        attn_config = {"embed_dim": E, "num_heads": int(config["nhead"])}
        self.self_attn = FusedAttention(state, attn_config, prefix=f"{prefix}self_attn.")
        self.w1 = state[f"{prefix}linear1.weight"].contiguous()  # (F, E)
        self.b1 = state.get(f"{prefix}linear1.bias")
        self.w2 = state[f"{prefix}linear2.weight"].contiguous()  # (E, F)
        self.b2 = state.get(f"{prefix}linear2.bias")
        self.norm1 = (state[f"{prefix}norm1.weight"], state.get(f"{prefix}norm1.bias"))
        self.norm2 = (state[f"{prefix}norm2.weight"], state.get(f"{prefix}norm2.bias"))
        self.eps = float(config["layer_norm_eps"])
        self.norm_first = bool(config["norm_first"])
        self.activation = ACTIVATIONS[config["activation"]]
        self.embed_dim = E

    def _norm(self, x: Tensor, params: tuple[Tensor, Tensor | None]) -> Tensor:
        return F.layer_norm(x, (self.embed_dim,), params[0], params[1], self.eps)

    def _ff(self, x: Tensor) -> Tensor:
        h = self.activation(F.linear(x, self.w1, self.b1))  # (..., F)
        return F.linear(h, self.w2, self.b2)  # (..., E)

    def forward(self, x: Tensor, attn_fn: AttnFn) -> Tensor:
        """x is (B, T, E) or packed (N, E); attn_fn(self_attn, h) returns self-attention of h."""
        if self.norm_first:
            x = x + attn_fn(self.self_attn, self._norm(x, self.norm1))
            x = x + self._ff(self._norm(x, self.norm2))
        else:
            x = self._norm(x + attn_fn(self.self_attn, x), self.norm1)
            x = self._norm(x + self._ff(x), self.norm2)
        return x


class EncoderStack:
    """num_layers EncoderLayers plus the optional final LayerNorm (nn.TransformerEncoder.norm)."""

    def __init__(self, state: dict[str, Tensor], config: dict) -> None:
        self.layers = [
            EncoderLayer(state, config, f"layers.{i}.") for i in range(int(config["num_layers"]))
        ]
        self.embed_dim = int(config["d_model"])
        self.eps = float(config["layer_norm_eps"])
        self.final_norm = (
            (state["norm.weight"], state.get("norm.bias")) if config["final_norm"] else None
        )

    def forward(self, x: Tensor, attn_fn: AttnFn) -> Tensor:
        """Run every layer then the final norm on (B, T, E) or packed (N, E) tokens."""
        for layer in self.layers:
            x = layer.forward(x, attn_fn)
        if self.final_norm is not None:
            x = F.layer_norm(x, (self.embed_dim,), *self.final_norm, self.eps)
        return x
