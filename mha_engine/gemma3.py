"""Gemma 3 as a bidirectional text encoder (google/embeddinggemma-300m) as engine modules.

Each layer puts its attention and its feed-forward each between two RMSNorms (Gemma's,
(1 + weight) * x) and adds the result to the residual: grouped-query attention of heads not as
wide as the model with a norm over each query and key head and rotary positions, over every key
(full layers) or over the keys at most `sliding_window` positions away in either direction
(sliding layers, as ModernBERT's: a band per query block on packed sequences longer than the
window), then a GeGLU feed-forward, down(gelu_tanh(gate) * up). The embeddings are the token
table scaled by sqrt(d_model); a final norm. Equal to transformers' Gemma3TextModel with
`use_bidirectional_attention` (EmbeddingGemma's configuration).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from .fused import ACTIVATIONS, gated_linear, linear
from .grouped_attention import GemmaRMSNorm, GroupedRotaryAttention, GroupedRotaryModel
from .rope import run_windowed_layers
from .text import TokenEmbeddings
from .text_config import LAYER_TYPES, Gemma3EncoderConfig
from .varlen import AttnBias, Plan

FULL, SLIDING = LAYER_TYPES


class Gemma3Embeddings(TokenEmbeddings):
    """embed_tokens times sqrt(d_model) (positions come from RoPE); a float32 table.

    transformers multiplies by sqrt(d_model) in the table's dtype (bf16 rounds it to 27.75 for
    768); the engine's table is float32, so the product is the fp32 one."""

    def __init__(self, config: Gemma3EncoderConfig) -> None:
        super().__init__(config)
        self.scale = math.sqrt(config.d_model)


class Gemma3Layer(nn.Module):
    """x + post_attention_layernorm(attention(input_layernorm(x))), then
    x + post_feedforward_layernorm(GeGLU(pre_feedforward_layernorm(x)))."""

    def __init__(self, config: Gemma3EncoderConfig, index: int) -> None:
        super().__init__()
        D, F_, eps = config.d_model, config.dim_feedforward, config.layer_norm_eps
        self.input_layernorm = GemmaRMSNorm(D, eps)
        self.self_attn = GroupedRotaryAttention(config, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(D, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(D, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(D, eps)
        self.gate_up = nn.Linear(D, 2 * F_, bias=False)  # rows [gate; up]
        self.down = nn.Linear(F_, D, bias=False)
        self.kind = config.layer_types[index]
        self.act = ACTIVATIONS[config.activation]

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        key_padding_mask: Tensor | None,
        plan: Plan | None,
        need_weights: bool,
        window: Tensor | AttnBias | None,
    ) -> tuple[Tensor, Tensor | None]:
        """x: dense (B, T, D) or packed (N, D) with its plan; cos/sin per position (T|N, hd)."""
        attn = self.self_attn
        merged, weights = attn.attend_rotary(
            self.input_layernorm(x), cos_sin, plan, key_padding_mask, False, need_weights, window
        )  # packed (N, E) or dense (B, T, E); on packed rows the band per sequence length
        x = x + self.post_attention_layernorm(linear(attn.out_proj, merged))  # (..., D)
        h = gated_linear(self.gate_up, self.down, self.pre_feedforward_layernorm(x), self.act)
        return x + self.post_feedforward_layernorm(h), weights


class Gemma3Stack(nn.Module):
    """The layers and the final norm, with EncoderStack's call signature (bidirectional only)."""

    cuda_graphs_refusal = "sliding-window layers take a band mask the kernel does not (Gemma 3)"
    attention_note = (
        "sliding-window layers: a sequence past the window attends by blocks of queries "
        "(scaled_dot_product_attention with a band mask); grouped-query attention"
    )

    def __init__(self, config: Gemma3EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Gemma3Layer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.d_model, config.layer_norm_eps)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        plan: Plan | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Dense (B, T, D) with an optional padding mask, or packed (N, D) with its plan."""
        if attn_mask is not None or is_causal or (plan is not None and any(plan.seq_causal)):
            raise ValueError("Gemma 3 here attends both ways: attn_mask and is_causal are refused")
        c = self.config
        ropes = {FULL: (c.rope_theta, c.rope_scaling), SLIDING: (c.local_rope_theta, None)}
        x, weights = run_windowed_layers(
            self.layers, x, plan, key_padding_mask, need_weights, c.head_dim, ropes,
            c.sliding_window,
        )  # fmt: skip
        return self.norm(x), weights


class Gemma3Model(GroupedRotaryModel):
    """A Gemma 3 encoder (EmbeddingGemma): TextEncoderModel's API over Gemma3Embeddings and
    Gemma3Stack; sentence-transformers' pooling and Dense modules behind it."""

    stack_class = Gemma3Stack
    embeddings_class = Gemma3Embeddings
