"""FusedAttention: nn.MultiheadAttention as an inference nn.Module with fused Q/K/V projections.

The fast path (SDPA) and the weights path sit side by side in `FusedAttention.attend` so the
two stay easy to compare; both reproduce `nn.MultiheadAttention` numbers for every option.
Projections are real nn.Linear modules (in_proj, out_proj; q_proj + kv_proj or k_proj/v_proj
when kdim/vdim differ), so they can be swapped (quantized); state dicts use PyTorch's names.
Grouped-query attention (num_kv_heads < num_heads) sizes the K/V projections to
num_kv_heads * head_dim; SDPA repeats K/V heads itself (enable_gqa), the weights path expands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MultiheadAttentionConfig
from .fused import linear, padded_gemm, plain_gemm
from .masks import causal_mask, merge_masks
from .packed_attention import attend_packed, packed_attention
from .varlen import AttnBias, Plan

# enable_gqa arrived in torch 2.5; older builds take the explicit repeat in `sdpa`.
SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, gqa: bool = False
) -> Tensor:
    """SDPA on (B, H, T, hd) queries and (B, Hkv, S, hd) keys/values; H % Hkv == 0.

    With gqa, SDPA's enable_gqa shares each K/V head among H / Hkv query heads; where a torch
    build lacks it, K/V heads are repeated explicitly (same numbers, more memory).
    """
    if not gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H, S, hd)
    v = v.repeat_interleave(groups, dim=1)  # (B, H, S, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def linear_rows(linear: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """x @ W[start:stop].T + b[start:stop]: a row block of an nn.Linear, or of a quantized
    Linear through its `rows` (packed once per block)."""
    rows = getattr(linear, "rows", None)
    if rows is not None:
        return rows(start, stop)(x)
    b = linear.bias
    w, b = linear.weight[start:stop], None if b is None else b[start:stop]
    return padded_gemm(plain_gemm(w, b, x), x)  # tiny batches padded (fused.py)


class FusedAttention(nn.Module):
    """One nn.MultiheadAttention block; Q/K/V projections fused wherever inputs are shared.

    kdim == vdim == embed_dim: one `in_proj` Linear (E -> E + 2KV), PyTorch's in_proj_weight.
    Otherwise `q_proj` plus `kv_proj` (kdim == vdim: K and V fused) or `k_proj` and `v_proj`.
    load_state_dict takes PyTorch's names (in_proj_weight, q_proj_weight, ...) and
    state_dict gives them back, so nn.MultiheadAttention state dicts load both ways.
    """

    def __init__(self, config: MultiheadAttentionConfig) -> None:
        super().__init__()
        self.config = config
        E, KV, bias = config.embed_dim, config.kv_dim, config.bias
        self.embed_dim, self.num_heads, self.head_dim = E, config.num_heads, config.head_dim
        self.num_kv_heads, self.kv_dim = config.num_kv_heads, KV
        self.kdim, self.vdim = config.kdim, config.vdim
        self.add_zero_attn = config.add_zero_attn
        self.in_proj = self.q_proj = self.kv_proj = self.k_proj = self.v_proj = None
        if config.same_embed_dim:
            self.in_proj = nn.Linear(E, E + 2 * KV, bias=bias)  # rows [Q; K; V]
        else:
            self.q_proj = nn.Linear(E, E, bias=bias)
            if config.kdim == config.vdim:
                self.kv_proj = nn.Linear(config.kdim, 2 * KV, bias=bias)  # rows [K; V]
            else:
                self.k_proj = nn.Linear(config.kdim, KV, bias=bias)
                self.v_proj = nn.Linear(config.vdim, KV, bias=bias)
        self.out_proj = nn.Linear(E, E, bias=bias)
        if config.add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, KV), requires_grad=False)
            self.bias_v = nn.Parameter(torch.empty(1, 1, KV), requires_grad=False)
        else:
            self.bias_k = self.bias_v = None
        self.cuda_grouped_calls = 0  # CUDA calls that took grouped SDPA, not the varlen kernel
        self.register_load_state_dict_pre_hook(_from_pytorch_names)
        self.register_state_dict_post_hook(_to_pytorch_names)

    @property
    def extra_keys(self) -> int:
        """Columns appended to every key sequence by add_bias_kv and add_zero_attn."""
        return int(self.bias_k is not None) + int(self.add_zero_attn)

    @property
    def is_gqa(self) -> bool:
        """Fewer K/V heads than query heads (grouped-query or multi-query attention)."""
        return self.num_kv_heads != self.num_heads

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Views of Q (..., E), K and V (..., KV) in the output of the fused in_proj."""
        E, KV = self.embed_dim, self.kv_dim
        return qkv[..., :E], qkv[..., E : E + KV], qkv[..., E + KV :]

    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """In-projection with as few GEMMs as the inputs allow; works on any leading shape."""
        E, KV = self.embed_dim, self.kv_dim
        if self.in_proj is not None:
            if key is query and value is query:
                return self.split_qkv(linear(self.in_proj, query))  # (..., E + 2KV): one GEMM
            q = linear_rows(self.in_proj, query, 0, E)  # (..., T, E)
            kv_proj, kv0 = self.in_proj, E  # K and V are the rows after Q
        else:
            q = linear(self.q_proj, query)  # (..., T, E)
            if self.kv_proj is None:
                return q, linear(self.k_proj, key), linear(self.v_proj, value)
            kv_proj, kv0 = self.kv_proj, 0
        if key is value:
            kv = linear_rows(kv_proj, key, kv0, kv0 + 2 * KV)  # (..., S, 2KV): one GEMM
            return q, kv[..., :KV], kv[..., KV:]
        k = linear_rows(kv_proj, key, kv0, kv0 + KV)  # (..., S, KV)
        v = linear_rows(kv_proj, value, kv0 + KV, kv0 + 2 * KV)  # (..., S, KV)
        return q, k, v

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        attn_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention on projected (B, T, E) / (B, S, KV) inputs; returns merged heads (B, T, E).

        With need_weights the probabilities are materialised as (B, H, T, S'); a row whose keys
        are all masked gives zero weights and zero output (PyTorch gives NaN there).
        attn_bias: an additive (1|B, H, T, S) score bias on top of the masks (MPNet's relative
        positions, position_bias.py).
        """
        B, T, E = q.shape
        S, H, hd, KV = k.shape[1], self.num_heads, self.head_dim, self.kv_dim
        if is_causal and attn_mask is None:
            plain = key_padding_mask is None and attn_bias is None
            if plain and not need_weights and self.extra_keys == 0:
                attn_mask = None  # SDPA builds the causal mask itself
            else:
                attn_mask = causal_mask(T, S, q.device)
                is_causal = False
        elif attn_mask is not None:
            is_causal = False  # like PyTorch, an explicit attn_mask wins over the is_causal hint
        mask = merge_masks(key_padding_mask, attn_mask, B, H, T, S, q.dtype)  # (B, H|1, T, S)
        if attn_bias is not None:
            mask = attn_bias.to(q.dtype) if mask is None else mask + attn_bias  # (B|1, H, T, S)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, KV)], dim=1)  # (B, S+1, KV)
            v = torch.cat([v, self.bias_v.expand(B, 1, KV)], dim=1)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, KV)], dim=1)  # (B, S', KV)
            v = torch.cat([v, v.new_zeros(B, 1, KV)], dim=1)
        if mask is not None and self.extra_keys:
            mask = F.pad(mask, (0, self.extra_keys))  # the appended keys are always visible
        Hkv = self.num_kv_heads
        q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.reshape(B, -1, Hkv, hd).transpose(1, 2)  # (B, Hkv, S', hd)
        v = v.reshape(B, -1, Hkv, hd).transpose(1, 2)  # (B, Hkv, S', hd)

        if not need_weights:
            y = sdpa(q, k, v, mask, is_causal, gqa=self.is_gqa)  # (B, H, T, hd)
            weights = None
        else:
            if self.is_gqa:  # query head h reads K/V head h // (H / Hkv)
                k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S', hd)
                v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S', hd)
            scores = (q * hd**-0.5) @ k.transpose(-2, -1)  # (B, H, T, S')
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)  # (B, H, T, S')
            if mask is not None:
                dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # (B, H|1, T, 1)
                weights = weights.masked_fill(dead, 0.0)
            y = weights @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, E)  # (B, T, E)
        return y, weights

    def attend_either(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: Plan | None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        attn_bias: Tensor | AttnBias | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Projected packed rows along their plan (causal as the plan says; no weights), or a
        dense batch through `attend`: the call a layer with its own projections makes.
        attn_bias: per sequence length on packed rows (varlen.AttnBias), a tensor on dense."""
        if plan is not None:  # kernels and SDPA groups (packed_attention.py)
            return attend_packed(self, plan, q, k, v, attn_bias=attn_bias), None  # (N, E)
        attend = (key_padding_mask, None, is_causal, need_weights, attn_bias)
        return self.attend(q, k, v, *attend)  # (B, T, E), weights

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        attn_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Batched (B, T, E) attention block: in_proj, attend, out_proj; weights (B, H, T, S').
        attn_bias: see `attend`."""
        q, k, v = self.project(query, key, value)  # (B, T, E), (B, S, KV), (B, S, KV)
        attend = (key_padding_mask, attn_mask, is_causal, need_weights, attn_bias)
        y, weights = self.attend(q, k, v, *attend)
        return linear(self.out_proj, y), weights  # (B, T, E)

    def forward_packed(
        self,
        query: Tensor,
        plan: Plan,
        key: Tensor | None = None,
        value: Tensor | None = None,
        residual: Tensor | None = None,
        attn_bias: AttnBias | None = None,
    ) -> Tensor:
        """Packed (N, E) queries (and (M, kdim|vdim) keys/values) attended per the plan's groups;
        a residual (N, E) is added inside out_proj (one fused GEMM on CPU); attn_bias gives a
        score bias per sequence length (varlen.AttnBias)."""
        key = query if key is None else key
        value = key if value is None else value
        return packed_attention(self, query, key, value, plan, residual, attn_bias)  # (N, E)


def _from_pytorch_names(module: FusedAttention, state: dict, prefix: str, *_: object) -> None:
    """load_state_dict pre-hook: nn.MultiheadAttention's names onto our Linear modules."""
    E, KV = module.embed_dim, module.kv_dim
    weight = state.pop(f"{prefix}in_proj_weight", None)  # (E + 2KV, E)
    bias = state.pop(f"{prefix}in_proj_bias", None)  # (E + 2KV,)
    if weight is not None:
        state[f"{prefix}in_proj.weight"] = weight
    separate = [state.pop(f"{prefix}{n}_proj_weight", None) for n in "qkv"]
    if separate[0] is not None:
        state[f"{prefix}q_proj.weight"] = separate[0]  # (E, E)
        if module.kv_proj is not None and None not in separate:
            state[f"{prefix}kv_proj.weight"] = torch.cat(separate[1:])  # (2KV, kdim)
        else:
            state[f"{prefix}k_proj.weight"], state[f"{prefix}v_proj.weight"] = separate[1:]
    if bias is not None:
        if module.in_proj is not None:
            state[f"{prefix}in_proj.bias"] = bias
        else:
            state[f"{prefix}q_proj.bias"] = bias[:E]
            if module.kv_proj is not None:
                state[f"{prefix}kv_proj.bias"] = bias[E:]
            else:
                state[f"{prefix}k_proj.bias"] = bias[E : E + KV]
                state[f"{prefix}v_proj.bias"] = bias[E + KV :]


def _to_pytorch_names(module: FusedAttention, state: dict, prefix: str, *_: object) -> None:
    """state_dict post-hook: our Linear modules under nn.MultiheadAttention's names."""
    KV = module.kv_dim

    def take(name: str) -> Tensor | None:
        return state.pop(f"{prefix}{name}", None)

    if f"{prefix}in_proj.weight" in state:
        state[f"{prefix}in_proj_weight"] = take("in_proj.weight")
        bias = take("in_proj.bias")
    elif f"{prefix}q_proj.weight" in state:
        state[f"{prefix}q_proj_weight"] = take("q_proj.weight")
        if f"{prefix}kv_proj.weight" in state:
            kv = take("kv_proj.weight")
            state[f"{prefix}k_proj_weight"], state[f"{prefix}v_proj_weight"] = kv[:KV], kv[KV:]
            rest = [take("kv_proj.bias")]
        else:
            state[f"{prefix}k_proj_weight"] = take("k_proj.weight")
            state[f"{prefix}v_proj_weight"] = take("v_proj.weight")
            rest = [take("k_proj.bias"), take("v_proj.bias")]
        q_bias = take("q_proj.bias")
        bias = None if q_bias is None else torch.cat([q_bias, *rest])
    else:
        return  # projections swapped for other modules (e.g. quantized): their own keys stay
    if bias is not None:
        state[f"{prefix}in_proj_bias"] = bias
