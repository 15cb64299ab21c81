"""The NaN/Inf checks on a batch's inputs and outputs (service.runtime.forward) and on a single
payload (service.oip.inputs): a float32 sum first, float64 only when that sum is not finite.
Finite values whose float32 sum overflows must pass; any NaN or Inf must not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.oip.inputs import _finite as finite_array
from service.runtime.forward import _finite as finite_tensor

BIG = 3e38  # finite in float32; a few of them overflow a float32 sum


def cases() -> list[tuple[str, np.ndarray, bool]]:
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((64, 512)).astype(np.float32)
    out = [
        ("normal", normal, True),
        ("big finite values", np.full((8, 512), BIG, np.float32), True),
    ]
    out.append(("big of both signs", np.array([BIG, BIG, -BIG, -BIG] * 64, np.float32), True))
    for name, value in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
        bad = normal.copy()
        bad[40, 300] = value
        out.append((name, bad, False))
    both = np.full(512, BIG, np.float32)
    both[7], both[9] = np.inf, -np.inf  # their sum is NaN: still refused
    out.append(("inf and -inf", both, False))
    return out


@pytest.mark.parametrize(("name", "values", "finite"), cases(), ids=[c[0] for c in cases()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_batch_check_on_tensors(name: str, values: np.ndarray, finite: bool, dtype) -> None:
    tensor = torch.from_numpy(values).to(dtype)
    expected = bool(torch.isfinite(tensor).all())  # BIG is Inf in float16: the cast decides
    if dtype != torch.float16:
        assert expected == finite
    assert finite_tensor(tensor) is expected


@pytest.mark.parametrize(("name", "values", "finite"), cases(), ids=[c[0] for c in cases()])
@pytest.mark.parametrize("datatype", ["FP32", "FP64", "FP16", "BF16"])
def test_payload_check_on_arrays(name: str, values: np.ndarray, finite: bool, datatype) -> None:
    if datatype == "BF16":  # the wire's raw bits
        array = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()
    else:
        array = values.astype(
            {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16}[datatype]
        )
    expected = bool(np.isfinite(values.astype(np.float16)).all()) if datatype == "FP16" else finite
    assert finite_array(datatype, array) is expected
