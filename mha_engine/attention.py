"""Multi-head attention math: fused in-projection, masks, SDPA fast path and a weights path.

The fast path and the weights path sit side by side in `FusedAttention.attend` so the two
stay easy to compare; both reproduce `nn.MultiheadAttention` numbers for every option.
Grouped-query attention (num_kv_heads < num_heads) sizes the K/V projections to
num_kv_heads * head_dim; SDPA repeats K/V heads itself (enable_gqa), the weights path expands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")
# enable_gqa arrived in torch 2.5; older builds take the explicit repeat in `sdpa`.
SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def additive_mask(mask: Tensor | None, dtype: torch.dtype, name: str) -> Tensor | None:
    """Turn a bool (True = ignore) or float mask into an additive float mask, like PyTorch."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, NEG_INF)
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
    return mask.to(dtype)


def causal_mask(tgt_len: int, src_len: int, device: torch.device) -> Tensor:
    """Bool (T, S) mask, True above the diagonal (top-left aligned, like SDPA's is_causal)."""
    return torch.ones(tgt_len, src_len, dtype=torch.bool, device=device).triu_(1)


def merge_masks(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    batch: int,
    num_heads: int,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Combine key_padding_mask (B, S) and attn_mask (T, S) | (B*H, T, S) into (B, H|1, T, S)."""
    merged = None
    if attn_mask is not None:
        attn_mask = additive_mask(attn_mask, dtype, "attn_mask")
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise ValueError(
                    f"attn_mask shape {tuple(attn_mask.shape)} != {(tgt_len, src_len)}"
                )
            merged = attn_mask.view(1, 1, tgt_len, src_len)
        elif attn_mask.dim() == 3:
            expected = (batch * num_heads, tgt_len, src_len)
            if attn_mask.shape != expected:
                raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} != {expected}")
            merged = attn_mask.view(batch, num_heads, tgt_len, src_len)
        else:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, src_len):
            raise ValueError(
                f"key_padding_mask shape {tuple(key_padding_mask.shape)} != {(batch, src_len)}"
            )
        kpm = additive_mask(key_padding_mask, dtype, "key_padding_mask")
        kpm = kpm.view(batch, 1, 1, src_len)
        merged = kpm if merged is None else merged + kpm
    return merged


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


class FusedAttention:
    """Weights of one nn.MultiheadAttention; Q/K/V projections fused where inputs are shared."""

    def __init__(self, state: dict[str, Tensor], config: dict, prefix: str = "") -> None:
        self.embed_dim = E = int(config["embed_dim"])
        self.num_heads = int(config["num_heads"])
        self.num_kv_heads = int(config.get("num_kv_heads") or self.num_heads)
        self.head_dim = E // self.num_heads
        self.kv_dim = KV = self.num_kv_heads * self.head_dim  # width of K and V after in_proj
        self.kdim = int(config.get("kdim") or E)
        self.vdim = int(config.get("vdim") or E)
        self.add_zero_attn = bool(config.get("add_zero_attn", False))
        if f"{prefix}in_proj_weight" in state:
            self.w_qkv = state[f"{prefix}in_proj_weight"].contiguous()  # (E + 2KV, E)
            w_q, w_k, w_v = self.w_qkv.split([E, KV, KV])
        else:
            self.w_qkv = None
            w_q, w_k, w_v = (state[f"{prefix}{n}_proj_weight"] for n in "qkv")
        b_qkv = state.get(f"{prefix}in_proj_bias")
        self.b_qkv = None if b_qkv is None else b_qkv.contiguous()  # (E + 2KV,)
        b_q, b_k, b_v = (None,) * 3 if b_qkv is None else self.b_qkv.split([E, KV, KV])
        self.w_q, self.w_k, self.w_v = w_q.contiguous(), w_k.contiguous(), w_v.contiguous()
        self.b_q, self.b_k, self.b_v = b_q, b_k, b_v
        # K and V share an input in cross attention with key is value: fuse them too.
        if self.w_qkv is not None:
            self.w_kv = self.w_qkv[E:]  # (2KV, E), a contiguous view
        elif self.kdim == self.vdim:
            self.w_kv = torch.cat([self.w_k, self.w_v])  # (2KV, kdim)
        else:
            self.w_kv = None
        self.b_kv = None if b_qkv is None else self.b_qkv[E:]
        self.out_w = state[f"{prefix}out_proj.weight"].contiguous()  # (E, E)
        self.out_b = state.get(f"{prefix}out_proj.bias")
        bias_k = state.get(f"{prefix}bias_k")
        self.bias_k = None if bias_k is None else bias_k.reshape(1, 1, KV)
        bias_v = state.get(f"{prefix}bias_v")
        self.bias_v = None if bias_v is None else bias_v.reshape(1, 1, KV)

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
        if key is query and value is query and self.w_qkv is not None:
            qkv = F.linear(query, self.w_qkv, self.b_qkv)  # (..., E + 2KV): one GEMM
            return self.split_qkv(qkv)
        q = F.linear(query, self.w_q, self.b_q)  # (..., T, E)
        if key is value and self.w_kv is not None:
            kv = F.linear(key, self.w_kv, self.b_kv)  # (..., S, 2KV)
            return q, kv[..., : self.kv_dim], kv[..., self.kv_dim :]
        return q, F.linear(key, self.w_k, self.b_k), F.linear(value, self.w_v, self.b_v)

    def out_proj(self, x: Tensor) -> Tensor:
        """Output projection on merged heads (..., E)."""
        return F.linear(x, self.out_w, self.out_b)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention on projected (B, T, E) / (B, S, KV) inputs; returns merged heads (B, T, E).

        With need_weights the probabilities are materialised as (B, H, T, S'); a row whose keys
        are all masked gives zero weights and zero output (PyTorch gives NaN there).
        """
        B, T, E = q.shape
        S, H, hd, KV = k.shape[1], self.num_heads, self.head_dim, self.kv_dim
        if is_causal and attn_mask is None:
            if key_padding_mask is None and not need_weights and self.extra_keys == 0:
                attn_mask = None  # SDPA builds the causal mask itself
            else:
                attn_mask = causal_mask(T, S, q.device)
                is_causal = False
        elif attn_mask is not None:
            is_causal = False  # like PyTorch, an explicit attn_mask wins over the is_causal hint
        mask = merge_masks(key_padding_mask, attn_mask, B, H, T, S, q.dtype)  # (B, H|1, T, S)
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

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Batched (B, T, E) attention block: in_proj, attend, out_proj."""
        q, k, v = self.project(query, key, value)  # (B, T, E), (B, S, E), (B, S, E)
        y, weights = self.attend(q, k, v, key_padding_mask, attn_mask, is_causal, need_weights)
        return self.out_proj(y), weights  # (B, T, E)
