"""BERT with rotary positions as engine modules: NomicBERT (nomic-ai/nomic-embed-text-v1 and
v1.5, nomic-bert-2048) and GTE (Alibaba-NLP/gte-multilingual-base, gte-multilingual-reranker-base).

Each layer is post-norm, as BERT's: multi-head attention with rotary positions (RoPE on queries
and keys, rotate_half), the output projection added to the residual and a LayerNorm; then a gated
feed-forward, down(act(gate(x)) * up(x)) (NomicBERT: SwiGLU without biases; GTE: GELU, a bias on
`down`), added and normalised. The embeddings are the token table plus the token-type table
(where there is one), then a LayerNorm: no position table. Equal to transformers'
NomicBertModel and GteModel; their sequence classifiers carry BERT's pooler and classifier
(heads.py).
"""

from __future__ import annotations

from torch import Tensor, nn

from .fused import ACTIVATIONS, gated_linear, linear
from .grouped_attention import GroupedRotaryAttention, GroupedRotaryModel
from .heads import TextClassifierModel
from .rope import rotary, token_positions
from .text import TextEmbeddings
from .text_config import RotaryBertConfig
from .varlen import Plan


class RotaryBertEmbeddings(TextEmbeddings):
    """BERT's embeddings without the position table (RoPE places tokens): word + token type
    (where the table exists), then LayerNorm; Hugging Face's names."""

    position_table = False


class RotaryBertLayer(nn.Module):
    """rotary attention -> + x -> post_attention_layernorm; gated MLP -> + x ->
    post_mlp_layernorm."""

    def __init__(self, config: RotaryBertConfig) -> None:
        super().__init__()
        D, F_, eps = config.d_model, config.dim_feedforward, config.layer_norm_eps
        self.self_attn = GroupedRotaryAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(D, eps=eps)
        self.gate_up = nn.Linear(D, 2 * F_, bias=False)  # rows [gate; up]
        self.down = nn.Linear(F_, D, bias=config.down_bias)
        self.post_mlp_layernorm = nn.LayerNorm(D, eps=eps)
        self.act = ACTIVATIONS[config.activation]

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        key_padding_mask: Tensor | None,
        plan: Plan | None,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """x: dense (B, T, D) or packed (N, D) with its plan; cos/sin per position (T|N, hd)."""
        attn = self.self_attn
        merged, weights = attn.attend_rotary(
            x, cos_sin, plan, key_padding_mask, False, need_weights
        )
        x = self.post_attention_layernorm(linear(attn.out_proj, merged, residual=x))  # (..., D)
        h = gated_linear(self.gate_up, self.down, x, self.act, x)
        return self.post_mlp_layernorm(h), weights


class RotaryBertStack(nn.Module):
    """The layers (no final norm: each layer ends with one), with EncoderStack's call signature
    (bidirectional only)."""

    cuda_graphs_refusal = "NomicBERT / GTE layers (RoPE) are not captured yet"

    def __init__(self, config: RotaryBertConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(RotaryBertLayer(config) for _ in range(config.num_layers))

    @property
    def attention_note(self) -> str:
        """What the diagnostics say of this stack's attention."""
        return (
            f"bidirectional multi-head attention with rotary positions ({self.config.model_type})"
        )

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
        c = self.config
        if attn_mask is not None or is_causal or (plan is not None and any(plan.seq_causal)):
            raise ValueError(
                f"{c.model_type} attends both ways: attn_mask and is_causal are refused"
            )
        positions = token_positions(x, plan)  # (T,) or (N,)
        cos_sin = rotary(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        weights: list[Tensor] = []
        for layer in self.layers:
            x, w = layer(x, cos_sin, key_padding_mask, plan, need_weights)
            if w is not None:
                weights.append(w)
        return x, weights


class RotaryBertModel(GroupedRotaryModel):
    """A NomicBERT or GTE encoder: TextEncoderModel's API (ids in, token states or vectors out)
    over RotaryBertEmbeddings and RotaryBertStack."""

    stack_class = RotaryBertStack
    embeddings_class = RotaryBertEmbeddings


class RotaryBertClassifierModel(TextClassifierModel, RotaryBertModel):
    """NomicBertForSequenceClassification / GteForSequenceClassification (GTE's rerankers): the
    encoder, the first token, then BERT's pooler (dense + tanh) and classifier."""
