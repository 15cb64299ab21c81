"""EngineModel: what every loaded model shares (read-only dimensions from its config, device
and dtype from its weights, input casting, the varlen wrapper, CUDA graph capture, diagnostics).
The concrete models are in models.py (attention and encoder) and decoder_models.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import introspect
from .attention import FusedAttention
from .config import EngineConfig
from .cuda_graphs import CudaGraphs, capture
from .devices import moved
from .packing import pack_varlen
from .quantize import is_int8
from .varlen import Plan, cumulative


class EngineModel(nn.Module):
    """Shared read-only attributes and input handling of every loaded model.

    Dimensions come from `config` (a frozen config dataclass); device and dtype are those of
    the weights, so `.to(device=..., dtype=...)` moves and casts the model in place.
    """

    architecture: str = ""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config

    embed_dim = property(lambda self: self.config.attention.embed_dim)
    num_heads = property(lambda self: self.config.attention.num_heads)
    num_kv_heads = property(lambda self: self.config.attention.num_kv_heads)
    head_dim = property(lambda self: self.config.attention.head_dim)
    kdim = property(lambda self: self.config.attention.kdim)
    vdim = property(lambda self: self.config.attention.vdim)
    num_layers = property(lambda self: len(self.attention_layers()))
    is_cross_attention_capable = property(lambda self: self.config.cross_attention)

    def _anchor(self) -> Tensor:
        """The first floating weight of `core`: its device and dtype are the model's.

        Found once by a walk over the weights, then re-checked per call along its path (each
        module still its parent's child, the tensor still its owner's: a few dict look-ups;
        `model.device` 1.7 µs, 5.9 µs with `get_parameter` by name, asked several times a
        forward). A replaced weight or module (load with assign=True, quantize) fails the check
        and the walk runs again. `.to()` keeps the objects: the cached tensor shows the change.
        """
        cached = self.__dict__.get("_anchor_cache")
        if cached is not None:
            chain, slot, attr, tensor = cached
            parent = self.core
            for name, child in chain:
                if parent._modules.get(name) is not child:
                    break
                parent = child
            else:
                if getattr(parent, slot).get(attr) is tensor:
                    return tensor
        core = self.core
        walks = (("_parameters", core.named_parameters), ("_buffers", core.named_buffers))
        for slot, named in walks:
            for name, t in named():
                if t.is_floating_point():
                    *path, attr = name.split(".")
                    chain, parent = [], core
                    for part in path:
                        parent = parent._modules[part]
                        chain.append((part, parent))
                    self.__dict__["_anchor_cache"] = (tuple(chain), slot, attr, t)
                    return t
        raise RuntimeError("the model holds no floating point weights to take a dtype from")

    @property
    def device(self) -> torch.device:
        return self._anchor().device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (text models keep their embedding tables in float32; int8 models
        compute in float32 between their int8 GEMMs)."""
        return self._anchor().dtype

    @property
    def precision(self) -> str:
        """What metadata and metrics call the model's dtype: "int8" once quantized, else the
        compute dtype's name (float32, bfloat16, float16)."""
        return "int8" if is_int8(self) else str(self.dtype).removeprefix("torch.")

    def attention_layers(self) -> list[FusedAttention]:
        raise NotImplementedError

    @property
    def core(self) -> nn.Module:
        """The module whose state_dict has PyTorch's names (what save_model writes)."""
        raise NotImplementedError

    def _cast(self, x: Tensor | None) -> Tensor | None:
        """Move a floating input to the model's device and dtype (no copy when already there)."""
        if x is None:
            return None
        anchor = self._anchor()
        if x.dtype == torch.bool:
            return moved(x, anchor.device)
        if torch.is_floating_point(x):
            return moved(x, anchor.device, anchor.dtype)
        raise TypeError(f"expected a floating point or bool tensor, got {x.dtype}")

    def forward_packed(self, query: Tensor, cu_seqlens: Tensor | Sequence[int], **kwargs) -> Tensor:
        raise NotImplementedError

    cuda_graphs: CudaGraphs | None = None  # set by enable_cuda_graphs

    @property
    def cuda_grouped_calls(self) -> int:
        """CUDA forwards in which an attention layer took grouped SDPA, not the varlen kernel."""
        return max((a.cuda_grouped_calls for a in self.attention_layers()), default=0)

    def packed_run(self, x: Tensor, plan: Plan) -> Tensor:
        """The packed self-attention forward on checked, cast rows x (N, E): what graphs capture."""
        raise NotImplementedError

    # widths of the memory tensors packed_cross_run takes (key and value, or a decoder's memory)
    cross_memory_widths: tuple[int, ...] = ()

    def packed_cross_run(
        self, x: Tensor, memory: tuple[Tensor, ...], self_plan: Plan, cross_plan: Plan
    ) -> Tensor:
        """The packed cross-attention forward of rows x (N, E) against checked, cast memory
        tensors (M, width): what cross-attention graphs capture."""
        raise NotImplementedError

    def enable_cuda_graphs(
        self,
        max_tokens: int = 4096,
        max_sequences: int = 256,
        max_graphs: int = 64,
        warm_max_len: int | None = None,
    ) -> CudaGraphs:
        """Replay unmasked packed self- and cross-attention forwards from CUDA graphs
        (mha_engine.cuda_graphs), capturing the non-causal self-attention buckets up to
        max_tokens now (sequences up to warm_max_len); other buckets on first use."""
        captures = type(self).packed_run is not EngineModel.packed_run
        crosses = type(self).packed_cross_run is not EngineModel.packed_cross_run
        self.cuda_graphs = capture(
            self, captures, crosses, max_tokens, max_sequences, max_graphs, warm_max_len
        )
        return self.cuda_graphs

    def _replay(self, x: Tensor, lens: list[int], causal: bool | None) -> Tensor | None:
        """x's self-attention forward by graph replay when graphs are on and the call can
        replay (`causal` from cuda_graphs.graph_mode: None when it cannot), else None."""
        graphs = self.cuda_graphs
        return None if graphs is None or causal is None else graphs(x, lens, causal)

    def _replay_cross(
        self,
        x: Tensor,
        lens: list[int],
        memory: tuple[Tensor, ...],
        memory_lens: list[int],
        causal: bool | None,
    ) -> Tensor | None:
        """x's cross-attention forward against `memory` by graph replay when graphs are on and
        the call can replay (`causal`: x's self-attention flag, None when it cannot), else
        None."""
        graphs = self.cuda_graphs
        if graphs is None or causal is None:
            return None
        return graphs.cross(x, lens, memory, memory_lens, causal)

    @torch.inference_mode()
    def forward_varlen(
        self,
        query: list[Tensor],
        key: list[Tensor] | None = None,
        value: list[Tensor] | None = None,
        key_padding_mask: list[Tensor | None] | None = None,
        is_causal: list[bool] | bool = False,
        bucket_padding: float = 0.0,
    ) -> list[Tensor]:
        """Lists of (T_i, E) sequences (and (S_i,) masks or None): a thin forward_packed wrapper."""
        q, q_lens, k, v, kv_lens, kpm, causal = pack_varlen(
            query, key, value, key_padding_mask, is_causal
        )
        cu_k = None if k is None else cumulative(kv_lens)
        out = self.forward_packed(
            q, cumulative(q_lens), k, v, cu_k, kpm, causal, bucket_padding=bucket_padding
        )
        return list(out.split(q_lens))  # [(T_i, E)]

    def diagnostics(self, batch_size: int = 1, seq_len: int = 128) -> dict[str, Any]:
        """SDPA backend picked for these shapes; why PyTorch's own MHA fast path would not run."""
        return introspect.diagnostics(self, batch_size, seq_len)

    def head_importance(self) -> list[dict[str, Any]]:
        """Per layer: each head's share of out_proj and the head-by-head cosine correlation."""
        return introspect.head_importance(self.attention_layers())

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_layers={self.num_layers}, device={self.device}, dtype={self.precision}"
        )
