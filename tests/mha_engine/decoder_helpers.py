"""Seeded PyTorch decoder references (nn.TransformerDecoder, nn.Transformer) for engine tests."""

from __future__ import annotations

import torch
from torch import nn


def perturb_norms(module: nn.Module) -> nn.Module:
    """LayerNorms start at weight 1, bias 0 and MHA biases at 0: perturb so they are tested."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "in_proj_bias" in name or "out_proj.bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return module.eval()


def make_decoder(
    d_model=16,
    nhead=4,
    dim_feedforward=32,
    num_layers=1,
    activation="relu",
    norm_first=False,
    bias=True,
    final_norm=False,
    eps=1e-5,
    seed=7,
) -> nn.TransformerDecoder:
    torch.manual_seed(seed)
    layer = nn.TransformerDecoderLayer(
        d_model,
        nhead,
        dim_feedforward,
        dropout=0.1,
        activation=activation,
        layer_norm_eps=eps,
        batch_first=True,
        norm_first=norm_first,
        bias=bias,
    )
    norm = nn.LayerNorm(d_model, eps=eps, bias=bias) if final_norm else None
    return perturb_norms(nn.TransformerDecoder(layer, num_layers, norm=norm))


def make_transformer(
    d_model=16,
    nhead=4,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dim_feedforward=32,
    activation="relu",
    norm_first=False,
    bias=True,
    seed=11,
) -> nn.Transformer:
    torch.manual_seed(seed)
    model = nn.Transformer(
        d_model,
        nhead,
        num_encoder_layers,
        num_decoder_layers,
        dim_feedforward,
        dropout=0.1,
        activation=activation,
        batch_first=True,
        norm_first=norm_first,
        bias=bias,
    )
    return perturb_norms(model)


def trailing_padding(lengths: list[int], total: int) -> torch.Tensor:
    """(B, total) bool key padding mask, True after each item's length."""
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


def pytorch_layer_weights(layers, x, mem, tgt_mask, memory_kpm):
    """Each PyTorch decoder layer's (self, cross) weights from its own MHAs, need_weights=True
    per head, following the layer's residual path (norm_first or not)."""
    found = []
    h = x
    with torch.no_grad():
        for layer in layers:
            pre = layer.norm1(h) if layer.norm_first else h
            sa, sw = layer.self_attn(pre, pre, pre, attn_mask=tgt_mask, average_attn_weights=False)
            mid = h + sa if layer.norm_first else layer.norm1(h + sa)
            q = layer.norm2(mid) if layer.norm_first else mid
            _, cw = layer.multihead_attn(
                q, mem, mem, key_padding_mask=memory_kpm, average_attn_weights=False
            )
            found.append((sw, cw))
            h = layer(h, mem, tgt_mask=tgt_mask, memory_key_padding_mask=memory_kpm)
    return found
