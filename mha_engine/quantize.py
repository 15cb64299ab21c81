"""int8: int8 weights and per-token dynamically quantized activations for every nn.Linear.

`quantize_int8(model)` swaps each nn.Linear of a float32 model for an `Int8Linear`; attention
(SDPA), LayerNorm, activations and residuals stay float32. Batch invariance is the constraint
that picked the kernel (figures: BENCHMARKS.md, "int8 kernels"; torch 2.13 CPU):

- `torch.ao.quantization.quantize_dynamic` (fbgemm `quantized::linear_dynamic`) quantizes the
  whole batch with ONE activation scale, so a request's numbers change with its batch-mates
  (and MiniLM's minimum cosine to fp32 fell to 0.75 on a packed batch). Not used.
- torchao's Int8DynamicActivationInt8WeightConfig (0.18) scales per token, but in eager mode on
  CPU it multiplies in int32 with torch.matmul: ~27x slower than fp32. `torch._int_mm` on CPU
  has no fast kernel either (seconds for one MiniLM-sized product).
- oneDNN's `qlinear_pointwise` (the op Inductor lowers x86 int8 linears to) is fast but takes
  one activation scale and zero point. So we quantize each row ourselves with its own scale and
  zero point, hand the kernel scale 1 / zero point 0, and fold each row's zero point into the
  GEMM as extra integer columns (row value z, weights summing to -sum_k W_q[c, k]); the row's
  scale is applied after. Integer accumulation is exact, so a row's result depends only on
  that row: bit-identical alone or in any batch (tested).

Activations use 7 bits (0..127, asymmetric per row), weights 8 bits (symmetric per output
channel). Without VNNI, x86 kernels add u8*s8 products in pairs into int16 (vpmaddubsw), which
saturates for 255*127*2; with activations <= 128 a pair stays <= 32512 < 32767, so the sums are
exact on every x86 CPU, and the same on all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .errors import DeviceError

ACT_LEVELS = 127  # activations: uint8 in [0, 127] per row (7 bits, see the module docstring)
WEIGHT_MAX = 127  # weights: int8 in [-127, 127] per output channel
TINY = torch.finfo(torch.float32).tiny
UNSUPPORTED_HINT = "use --dtype float32 or --dtype bfloat16"


class Int8Unsupported(DeviceError):
    """This torch build or device cannot run the int8 path."""


def int8_unsupported_reason(device: torch.device | str = "cpu") -> str | None:
    """Why int8 cannot run here (None when it can): CPU with oneDNN's int8 linear only."""
    device = torch.device(device)
    if device.type != "cpu":
        return (
            f"int8 runs on CPU only (oneDNN int8 GEMMs), not on {device.type}; {UNSUPPORTED_HINT}"
        )
    if not torch.backends.mkldnn.is_available():
        return f"int8 needs a torch build with oneDNN (mkldnn); {UNSUPPORTED_HINT}"
    ops = torch.ops.onednn
    if not (hasattr(ops, "qlinear_prepack") and hasattr(ops, "qlinear_pointwise")):
        return f"int8 needs torch.ops.onednn.qlinear_pointwise (torch >= 2.2); {UNSUPPORTED_HINT}"
    return None


def _zero_point_columns(weight_q: Tensor) -> Tensor:
    """(M, J) int8 columns summing per row to -sum_k weight_q[c, k], J a multiple of 4."""
    remaining = -weight_q.sum(dim=1, dtype=torch.int64)  # (M,)
    columns = []
    while bool(remaining.ne(0).any()) or not columns:
        take = remaining.clamp(-WEIGHT_MAX, WEIGHT_MAX)
        columns.append(take)
        remaining = remaining - take
    while len(columns) % 4:
        columns.append(torch.zeros_like(remaining))
    return torch.stack(columns, dim=1).to(torch.int8)  # (M, J)


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per row at run time.

    Inputs (..., in_features) in float32 (other float dtypes are upcast); output float32.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        reason = int8_unsupported_reason(weight.device)
        if reason is not None:
            raise Int8Unsupported(reason)
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1).div(WEIGHT_MAX).clamp(min=TINY)  # (M,)
        weight_q = torch.round(weight / scale[:, None]).clamp(-WEIGHT_MAX, WEIGHT_MAX)
        weight_q = weight_q.to(torch.int8)  # (M, K)
        self.register_buffer("weight_int8", weight_q)
        self.register_buffer("weight_scale", scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)
        augmented = torch.cat([weight_q, _zero_point_columns(weight_q)], dim=1)  # (M, K + J)
        self._width = augmented.shape[1]
        self._packed = torch.ops.onednn.qlinear_prepack(augmented, None)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)  # weights: symmetric
        self._row_blocks: dict[tuple[int, int], Int8Linear] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def dequantize(self) -> Tensor:
        """The float32 weight (M, K) the int8 values and scales stand for."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def rows(self, start: int, stop: int) -> Int8Linear:
        """The Linear of output rows [start, stop) (e.g. K/V of a fused in_proj), packed once."""
        key = (start, stop)
        if key not in self._row_blocks:
            weight = self.dequantize()[start:stop]
            bias = None if self.bias is None else self.bias[start:stop]
            self._row_blocks[key] = Int8Linear(weight, bias)  # same int8 values, same scales
        return self._row_blocks[key]

    def quantize_rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 (N, K + J) rows with their zero points in the extra columns, and scales (N,).

        Elementwise ops and exact min/max only: each value is computed the same way whichever
        batch it is in (tested bit for bit).
        """
        N, K = x.shape
        lo = x.amin(dim=1).clamp_(max=0.0)  # (N,) 0 is always representable
        hi = x.amax(dim=1).clamp_(min=0.0)
        scale = (hi - lo).div_(ACT_LEVELS).clamp_(min=TINY)  # (N,)
        inv = scale.reciprocal()
        zero = (lo * inv).neg_().round_()  # (N,) in [0, 127]
        t = torch.addcmul(zero.add(0.5)[:, None], x, inv[:, None])  # (N, K) in [0, 128]
        # ^ x / scale + zero + 0.5: the uint8 truncation below rounds it to nearest.
        q = torch.empty(N, self._width, dtype=torch.uint8, device=x.device)
        q[:, :K] = t
        q[:, K:] = zero[:, None]
        return q, scale

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (N, K)
        if x2.shape[0] == 0:
            return x2.new_zeros(*lead, self.out_features)
        q, scale = self.quantize_rows(x2)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, self._packed, self.weight_scale, self._zero_points, None,
            1.0, 0, torch.float32, "none", [], "",
        )  # (N, M) = exact int32 sums * weight_scale  # fmt: skip
        if self.bias is None:
            y.mul_(scale[:, None])
        else:
            torch.addcmul(self.bias, y, scale[:, None], out=y)  # one pass: y * scale + bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weights int8 per channel, activations 7-bit per row"
        )


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of a float32 CPU model for an Int8Linear, in place; returns it.

    Raises Int8Unsupported (saying what to use instead) where the device or build lacks the
    kernels, before changing anything.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no nn.Linear to quantize")
    for name, linear in linears:
        reason = int8_unsupported_reason(linear.weight.device)
        if reason is not None:
            raise Int8Unsupported(reason)
        if linear.weight.dtype != torch.float32:
            raise ValueError(f"{name} is {linear.weight.dtype}; int8 quantizes a float32 model")
    _probe()
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(linear))
    return model


def _probe() -> None:
    """Run one tiny int8 product; a build whose kernel fails says so once, clearly."""
    weight = torch.linspace(-1.0, 1.0, 64).view(8, 8)
    try:
        out = Int8Linear(weight, None)(torch.ones(2, 8))
    except RuntimeError as exc:
        raise Int8Unsupported(
            f"oneDNN's int8 linear failed on this CPU ({str(exc).splitlines()[0]}); "
            f"{UNSUPPORTED_HINT}"
        ) from exc
    if not torch.allclose(out, torch.ones(2, 8) @ weight.T, atol=0.05):
        raise Int8Unsupported(f"oneDNN's int8 linear gave wrong numbers here; {UNSUPPORTED_HINT}")


def is_int8(model: nn.Module) -> bool:
    """True once quantize_int8 has run on the model."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
