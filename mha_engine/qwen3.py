"""Qwen3 text embedders (Qwen3-Embedding-0.6B/4B/8B) as engine modules: the decoder as an encoder;
the Llama family (Llama, Mistral, Qwen2: hf_llama.py) runs on the same modules.

Each layer is pre-norm (RMSNorm): fused Q/K/V projections of num_heads query heads and
num_kv_heads key/value heads of head_dim each (grouped-query attention; num_heads * head_dim need
not equal the model width), an RMSNorm over each query and key head, rotary positions (RoPE),
causal attention, the output projection back to the model width, then a SwiGLU feed-forward,
down(silu(gate(x)) * up(x)). A final RMSNorm. Equal to transformers' Qwen3Model; without the
per-head norms (config.head_norms False) and with the family's biases, to its LlamaModel,
MistralModel and Qwen2Model.

Every sequence attends causally, packed or padded, unless config.json says `is_causal: false`
(transformers 5's switch that turns a decoder's attention bidirectional, as bidirectional Qwen3
embedders set it): the plan says which for every sequence (the CPU varlen kernel and CUDA flash
take both), so a sequence's numbers depend on it alone. Positions restart at 0 in every sequence;
transformers counts from 0 over the padded width, which equals ours with right padding (RoPE
depends on relative positions only, so left padding differs only by rounding).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .fused import gated_linear, linear
from .grouped_attention import GroupedRotaryAttention, GroupedRotaryModel, RMSNorm
from .rope import rotary, token_positions
from .score_head import ScoreClassifierModel
from .text import TokenEmbeddings
from .text_config import Qwen3EncoderConfig
from .varlen import Plan


class Qwen3Layer(nn.Module):
    """input_layernorm -> rotary GQA -> + x; post_attention_layernorm -> SwiGLU -> + x."""

    def __init__(self, config: Qwen3EncoderConfig) -> None:
        super().__init__()
        D, F_, eps = config.d_model, config.dim_feedforward, config.layer_norm_eps
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = GroupedRotaryAttention(config)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.gate_up = nn.Linear(D, 2 * F_, bias=config.mlp_bias)  # rows [gate; up]
        self.down = nn.Linear(F_, D, bias=config.mlp_bias)

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        key_padding_mask: Tensor | None,
        plan: Plan | None,
        need_weights: bool,
        causal: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """x: dense (B, T, D) or packed (N, D) with its plan; cos/sin (T|N, hd)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        merged, weights = attn.attend_rotary(
            h, cos_sin, plan, key_padding_mask, causal, need_weights
        )
        x = linear(attn.out_proj, merged, residual=x)  # (..., D)
        h = self.post_attention_layernorm(x)
        return gated_linear(self.gate_up, self.down, h, F.silu, x), weights


class Qwen3Stack(nn.Module):
    """The layers and the final norm, with EncoderStack's call signature (causal unless the
    config says otherwise)."""

    cuda_graphs_refusal = "Qwen3 / Llama-family layers (RoPE, GQA) are not captured yet"

    def __init__(self, config: Qwen3EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Qwen3Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model, config.layer_norm_eps)

    @property
    def attention_note(self) -> str:
        """What the diagnostics say of this stack's attention."""
        kind = "causal" if self.config.causal else "bidirectional"
        return f"{kind} grouped-query attention with rotary positions ({self.config.model_type})"

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = True,
        plan: Plan | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Dense (B, T, D) with an optional padding mask, or packed (N, D) with its plan; causal
        as config.causal says (the flag is taken for EncoderStack's signature; an attn_mask, or
        a plan that disagrees with the config, is refused)."""
        c = self.config
        if attn_mask is not None or (plan is not None and set(plan.seq_causal) - {c.causal}):
            how = "causally" if c.causal else "bidirectionally"
            raise ValueError(
                f"this {c.model_type} model attends {how}: attn_mask and plans of the other kind "
                "are refused"
            )
        positions = token_positions(x, plan)  # (T,) or (N,)
        cos_sin = rotary(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)  # (T|N, hd)
        weights: list[Tensor] = []
        for layer in self.layers:
            x, w = layer(x, cos_sin, key_padding_mask, plan, need_weights, c.causal)
            if w is not None:
                weights.append(w)
        return self.norm(x), weights


class Qwen3Model(GroupedRotaryModel):
    """A Qwen3 embedder: TextEncoderModel's API (ids in, token states or vectors out; usually
    last-token pooling) over TokenEmbeddings and Qwen3Stack, every sequence causal unless
    config.causal is False (the caller's is_causal gives way to the config: it is the model's)."""

    stack_class = Qwen3Stack
    embeddings_class = TokenEmbeddings

    def _run(self, src, mask, src_key_padding_mask, is_causal, keep_weights):
        return super()._run(src, mask, src_key_padding_mask, self.config.causal, keep_weights)

    def _encode(self, x, lens, key_padding_mask, is_causal, bucket_padding) -> Tensor:
        return super()._encode(x, lens, key_padding_mask, self.config.causal, bucket_padding)


class Qwen3ClassifierModel(ScoreClassifierModel, Qwen3Model):
    """Qwen3 rerankers and classifiers: Qwen3ForSequenceClassification (the seq-cls form of
    Qwen3-Reranker, its fine-tunes), or a causal LM that sentence-transformers scores with
    LogitScore (Qwen/Qwen3-Reranker-0.6B/4B/8B): the encoder, then one Linear at one token."""
