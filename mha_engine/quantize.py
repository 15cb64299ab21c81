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
  one activation scale and zero point. So each row is quantized around its own midpoint with
  its own scale, x ~ scale * (q - zero_point) + mid, the kernel gets scale 1 and the fixed
  zero_point (it subtracts it exactly, in integers), and the float epilogue applies the row's
  scale and adds mid * (the weight row sums) and the bias. The integer sums are exact and the
  epilogue is elementwise, so a row's result depends only on that row: bit-identical alone or
  in any batch (tested). The per-row passes run as compiled C where a C compiler exists
  (int8_rows: one pass per row instead of nine over the batch, bit-identical).

Activations: asymmetric per row (min..max over 2 * levels steps). With VNNI the u8 x s8
products go straight into int32 (vpdpbusd): 8 bits, q in [1, 255] around 128. Without VNNI,
x86 kernels add them in pairs into int16 (vpmaddubsw), which saturates past 32767: 7 bits,
q in [1, 127] around 64 (pairs stay <= 127 * 127 * 2 = 32258), exact there too. Weights: 8 bits,
symmetric per output channel. (s8 activations would need no offset, but oneDNN runs u8 x s8
only: its s8 x s8 linear took 5 s for one MiniLM product on torch 2.13.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import int8_rows
from .errors import DeviceError
from .int8_rows import TINY

WEIGHT_MAX = 127  # weights: int8 in [-127, 127] per output channel
UNSUPPORTED_HINT = "use --dtype float32 or --dtype bfloat16"


class Int8Unsupported(DeviceError):
    """This torch build or device cannot run the int8 path."""


def activation_levels() -> int:
    """Steps on each side of a row's midpoint: 127 (8-bit u8) where the CPU has VNNI, else 63
    (7 bits: int16 pair sums without VNNI stay exact only for u8 <= 128)."""
    return 127 if getattr(torch.cpu, "_is_vnni_supported", lambda: False)() else 63


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


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per row at run time.

    Inputs (..., in_features) in float32 (other float dtypes are upcast); output float32.
    `levels` (steps each side of a row's midpoint) defaults to this CPU's activation_levels().
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, levels: int | None = None) -> None:
        super().__init__()
        reason = int8_unsupported_reason(weight.device)
        if reason is not None:
            raise Int8Unsupported(reason)
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        self.levels = activation_levels() if levels is None else levels
        if not 1 <= self.levels <= 127:  # q = round(t) must fit int8 before the + zero point
            raise ValueError(f"levels must be in [1, 127], got {self.levels}")
        self.zero_point = self.levels + 1  # q in [1, 2 * levels + 1]
        scale = weight.abs().amax(dim=1).div(WEIGHT_MAX).clamp(min=TINY)  # (M,)
        weight_q = torch.round(weight / scale[:, None]).clamp(-WEIGHT_MAX, WEIGHT_MAX)
        weight_q = weight_q.to(torch.int8)  # (M, K)
        self.register_buffer("weight_int8", weight_q)
        self.register_buffer("weight_scale", scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)
        # sum_k of the dequantized weight row: what a row's midpoint contributes to each output
        self._weight_sums = (weight_q.double().sum(dim=1) * scale.double()).float()  # (M,)
        self._packed = torch.ops.onednn.qlinear_prepack(weight_q, None)
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
            # same int8 values, same scales
            self._row_blocks[key] = Int8Linear(weight, bias, self.levels)
        return self._row_blocks[key]

    def quantize_rows(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """uint8 rows q (N, K) in [1, 2 * levels + 1], scales (N,) and midpoints (N,):
        x ~ scale * (q - zero_point) + mid, per row (int8_rows: compiled, or eager ops)."""
        return int8_rows.quantize_rows(x, self.levels)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x (..., K) -> (..., M), plus `residual` (..., M) when given (added in the epilogue)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (N, K)
        if x2.shape[0] == 0:
            y = x2.new_zeros(*lead, self.out_features)
            return y if residual is None else y + residual
        q, scale, mid = self.quantize_rows(x2)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, self.zero_point, self._packed, self.weight_scale, self._zero_points, None,
            1.0, 0, torch.float32, "none", [], "",
        )  # (N, M) = exact int32 sums of (q - zero_point) * W_q, times weight_scale  # fmt: skip
        r2 = None if residual is None else residual.reshape(-1, self.out_features)  # (N, M)
        y = int8_rows.rescale_rows(y, scale, mid, self.bias, self._weight_sums, r2)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        bits = (2 * self.levels + 1).bit_length()
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weights int8 per channel, "
            f"activations {bits}-bit per row"
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
    x = torch.linspace(-2.0, 3.0, 16).view(2, 8)
    try:
        out = Int8Linear(weight, None)(x)
    except RuntimeError as exc:
        raise Int8Unsupported(
            f"oneDNN's int8 linear failed on this CPU ({str(exc).splitlines()[0]}); "
            f"{UNSUPPORTED_HINT}"
        ) from exc
    if not torch.allclose(out, x @ weight.T, atol=0.05):
        raise Int8Unsupported(f"oneDNN's int8 linear gave wrong numbers here; {UNSUPPORTED_HINT}")


def is_int8(model: nn.Module) -> bool:
    """True once quantize_int8 has run on the model."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
