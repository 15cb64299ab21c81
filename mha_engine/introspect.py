"""Cheap introspection: SDPA backend selection, PyTorch fast-path blockers, head importance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import cpu_varlen, fused
from .fused import cpu_capability, fused_cpu_enabled, worth_packing
from .int8_rows import kernel_status

if TYPE_CHECKING:
    from .attention import FusedAttention
    from .engine_model import EngineModel


def sdpa_backend(
    device: torch.device, dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int
) -> str:
    """Name of the kernel F.scaled_dot_product_attention picks for these inputs, or 'unknown'."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    q = torch.empty(batch, heads, seq, head_dim, device=device, dtype=dtype)
    try:
        index = int(choose(q, q, q))
        name = torch.nn.attention.SDPBackend(index).name.lower()
    except (RuntimeError, ValueError, AttributeError):
        return "unknown"
    if device.type == "cpu" and name == "flash_attention":
        return "cpu-flash"
    return {"flash_attention": "flash", "efficient_attention": "efficient"}.get(name, name)


def pytorch_fast_path_blockers(model: EngineModel) -> list[str]:
    """Why nn.MultiheadAttention / nn.TransformerEncoderLayer in eval would skip their fast path.

    Mirrors the checks in torch.nn.modules.activation.MultiheadAttention.forward and
    TransformerEncoderLayer.forward for batch_first=True self-attention without masks.
    """
    config, reasons = model.config, []
    attn = config.attention
    if not torch.backends.mha.get_fastpath_enabled():
        reasons.append("torch.backends.mha.get_fastpath_enabled() was not True")
    if model.num_heads % 2:
        reasons.append("num_heads is odd")
    if model.num_kv_heads != model.num_heads:
        reasons.append("num_kv_heads differs from num_heads (nn.MultiheadAttention has no GQA)")
    if model.architecture == "multihead_attention":
        if not attn.bias:
            reasons.append("in_proj_bias is None (bias=False)")
        if attn.add_bias_kv:
            reasons.append("bias_k and bias_v are not None (add_bias_kv=True)")
        if attn.add_zero_attn:
            reasons.append("add_zero_attn was enabled")
        if model.kdim != model.embed_dim or model.vdim != model.embed_dim:
            reasons.append("_qkv_same_embed_dim was not True (kdim/vdim differ from embed_dim)")
    else:
        if not config.bias:
            reasons.append("self_attn was passed bias=False")
        if config.activation not in ("relu", "gelu"):
            reasons.append("activation_relu_or_gelu was not True (tanh-approximate gelu)")
    if model.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reasons.append(f"dtype {model.dtype} is not supported by the native kernel")
    return reasons


def engine_path(model: EngineModel) -> str:
    """How the layers run: prepacked oneDNN linears on CPU (fused.py), plain GEMMs elsewhere."""
    fused_cpu = (
        model.device.type == "cpu"
        and model.precision in ("float32", "bfloat16")
        and fused_cpu_enabled()
    )
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    plain = sum(not worth_packing(w) for w in weights)
    if model.device.type == "cpu" and model.precision == "bfloat16" and not fused.ONEDNN_BF16:
        gemms = "bf16 GEMMs computed in float32 (oneDNN has no bf16 kernels for this CPU)"
    elif fused_cpu and plain == len(weights):
        gemms = "plain F.linear GEMMs (weights too small for oneDNN's per-call cost)"
    elif fused_cpu:
        gemms = "prepacked oneDNN in_proj / out_proj+residual / FFN (GELU, residual fused)"
        if plain:
            gemms += f"; {plain} small linear(s) as plain F.linear"
    elif model.precision == "int8":
        gemms = f"int8 oneDNN GEMMs (per-row activation scales; row passes {kernel_status()})"
    else:
        gemms = "fused in_proj GEMM"
    stack = getattr(model, "encoder", None)
    if getattr(stack, "position_bias", None) is not None:  # no kernel takes the bias
        alibi = getattr(stack.config, "alibi", False)
        kind = "ALiBi" if alibi else "MPNet's relative position bias"
        return f"{gemms} + scaled_dot_product_attention with {kind}"
    note = getattr(stack, "attention_note", None)  # ModernBERT's sliding-window layers
    if model.device.type != "cpu" or not cpu_varlen.max_len(model.dtype):
        return f"{gemms} + scaled_dot_product_attention" + (f"; {note}" if note else "")
    attention = cpu_varlen.kernel_status()
    if attention.startswith("compiled"):
        attention = (
            f"varlen attention kernel {attention} for sequences of up to "
            f"{cpu_varlen.max_len(model.dtype)} tokens, scaled_dot_product_attention beyond"
        )
    else:
        attention = f"scaled_dot_product_attention (varlen attention kernel {attention})"
    return f"{gemms} + {attention}" + (f"; {note}" if note else "")


def diagnostics(model: EngineModel, batch_size: int = 1, seq_len: int = 128) -> dict[str, Any]:
    """Backend and fast-path facts for an info metric; every value is a str, int or bool."""
    backend = sdpa_backend(
        model.device, model.dtype, batch_size, model.num_heads, seq_len, model.head_dim
    )
    blockers = pytorch_fast_path_blockers(model)
    return {
        "architecture": model.architecture,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "precision": model.precision,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "sdpa_backend": backend,
        "cpu_capability": cpu_capability() if model.device.type == "cpu" else "none (not on CPU)",
        "engine_path": engine_path(model),
        "pytorch_fast_path": not blockers,
        "pytorch_fast_path_blockers": "; ".join(blockers) or "none",
        "torch_version": torch.__version__,
    }


def head_importance(layers: list[FusedAttention]) -> list[dict[str, Any]]:
    """Per layer: each head's share of ||out_proj.weight||_F and cosine similarity between heads."""
    report = []
    for index, attn in enumerate(layers):
        H, hd = attn.num_heads, attn.head_dim
        out = attn.out_proj
        w = out.dequantize() if hasattr(out, "dequantize") else out.weight.detach().float()
        D = w.shape[0]  # the model width (Qwen3: not H * hd)
        w = w.view(D, H, hd).transpose(0, 1).reshape(H, D * hd)  # (H, D*hd)
        norms = w.norm(dim=1)  # (H,)
        total = norms.sum()
        share = norms / total if total > 0 else torch.full_like(norms, 1.0 / H)
        unit = w / norms.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # (H, D*hd)
        correlation = unit @ unit.T  # (H, H)
        report.append(
            {
                "layer": index,
                "num_heads": H,
                "head_share": share.tolist(),
                "head_norm": norms.tolist(),
                "correlation": correlation.tolist(),
            }
        )
    return report
