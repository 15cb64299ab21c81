"""ModernBERT encoders (answerdotai/ModernBERT, gte-modernbert, modernbert-embed) as engine modules.

Each layer is pre-norm (the first without its attention norm): fused Q/K/V with rotary positions
(RoPE) applied to queries and keys, attention over every key (full layers) or over the keys
within `sliding_window` tokens of the query (sliding layers, a band mask), then a GeGLU
feed-forward, act(input) * gate. No biases; a final norm; the embeddings are a token table and a
LayerNorm (no position table: positions come from RoPE). Equal to transformers' ModernBertModel.

Rotary angles are position * 1 / theta^(2i / head_dim), each layer kind with its own theta,
computed once per forward. A sliding layer's packed sequences longer than the window attend by
blocks of queries against the keys in reach (a small band mask per block, varlen.LocalWindow),
so their cost grows with T, not T^2; sequences no longer than the window run as in a full layer
(the CPU varlen kernel, decided per sequence). The dense path takes a (T, T) band mask.
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import FusedAttention
from .config import MultiheadAttentionConfig
from .fused import ACTIVATIONS, gated_linear, linear
from .heads import TextClassifierModel
from .rope import rotate, run_windowed_layers
from .text import RotaryTables
from .text_config import LAYER_TYPES, TextEncoderConfig
from .text_model import TextEncoderModel
from .varlen import AttnBias, Plan

FULL, SLIDING = LAYER_TYPES


class ModernBertEmbeddings(RotaryTables):
    """tok_embeddings then a LayerNorm (Hugging Face's names); float32 tables (Float32Tables).
    Positions are taken for TextEmbeddings' interface and unused: RoPE places tokens."""

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=False)

    def _table(self) -> Tensor:
        return self.tok_embeddings.weight

    def forward(self, input_ids: Tensor, position_ids=None, token_type_ids=None) -> Tensor:
        return self.norm(self.tok_embeddings(input_ids))  # (..., D) float32

    def forward_packed(self, input_ids: Tensor, lengths: list[int], token_type_ids=None) -> Tensor:
        return self.forward(input_ids)  # (N, D)


class ModernBertLayer(nn.Module):
    """attn_norm (not in layer 0) -> rotary attention -> + x; mlp_norm -> GeGLU -> + x."""

    def __init__(self, config: TextEncoderConfig, index: int) -> None:
        super().__init__()
        E, F_, eps = config.d_model, config.dim_feedforward, config.layer_norm_eps
        self.attn_norm = nn.LayerNorm(E, eps=eps, bias=False) if index > 0 else None
        self.self_attn = FusedAttention(MultiheadAttentionConfig(E, config.nhead, bias=False))
        self.mlp_norm = nn.LayerNorm(E, eps=eps, bias=False)
        self.Wi = nn.Linear(E, 2 * F_, bias=False)  # input and gate, stacked
        self.Wo = nn.Linear(F_, E, bias=False)
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
        """x: dense (B, T, E) or packed (N, E) with its plan; cos/sin per position (T|N, hd)."""
        attn = self.self_attn
        h = x if self.attn_norm is None else self.attn_norm(x)
        qkv = linear(attn.in_proj, h)  # (..., 3E)
        q, k, v = attn.split_qkv(qkv)
        q, k = rotate(q, *cos_sin, attn.num_heads), rotate(k, *cos_sin, attn.num_heads)
        merged, weights = attn.attend_either(
            q, k, v, plan, key_padding_mask, need_weights=need_weights, attn_bias=window
        )  # packed (N, E) or dense (B, T, E); on packed rows the band per sequence length
        x = linear(attn.out_proj, merged, residual=x)
        # Wi's rows [input; gate]: the first half activated, as gated_linear's [gate; up]
        return gated_linear(self.Wi, self.Wo, self.mlp_norm(x), self.act, x), weights


class ModernBertStack(nn.Module):
    """The layers and the final norm, with EncoderStack's call signature (bidirectional only)."""

    cuda_graphs_refusal = "sliding-window layers take a band mask the kernel does not (ModernBERT)"
    attention_note = (
        "sliding-window layers: a sequence past the window attends by blocks of queries "
        "(scaled_dot_product_attention with a band mask)"
    )

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=False)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        plan: Plan | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Dense (B, T, E) with an optional padding mask, or packed (N, E) with its plan."""
        if attn_mask is not None or is_causal or (plan is not None and any(plan.seq_causal)):
            raise ValueError("ModernBERT attends both ways: attn_mask and is_causal are not taken")
        c = self.config
        ropes = {FULL: (c.rope_theta, None), SLIDING: (c.local_rope_theta, None)}
        x, weights = run_windowed_layers(
            self.layers, x, plan, key_padding_mask, need_weights, c.d_model // c.nhead, ropes,
            c.sliding_window,
        )  # fmt: skip
        return self.final_norm(x), weights


class ModernBertModel(TextEncoderModel):
    """A ModernBERT encoder: TextEncoderModel's API (ids in, token states or vectors out) over
    ModernBertEmbeddings and ModernBertStack."""

    stack_class = ModernBertStack
    embeddings_class = ModernBertEmbeddings


class ModernBertClassifierModel(TextClassifierModel):
    """ModernBertForSequenceClassification: the encoder, pooled (first token or mean), then
    head.dense, activation, head.norm and the classifier (heads.py)."""

    stack_class = ModernBertStack
    embeddings_class = ModernBertEmbeddings
