"""The engine's CUDA varlen route on a real GPU (skipped without one, saying why): the flash
(fp16/bf16) and memory-efficient (fp32) kernels against nn.MultiheadAttention per sequence, and
bit-exact batch invariance (a sequence alone or packed with others). Unverified until a GPU run:
the tolerances below are first estimates for the reduced precisions."""

from __future__ import annotations

import pytest
import torch

from mha_engine.checkpoint import model_from_state_dict
from mha_engine.save import module_config, module_state
from mha_engine.varlen import make_plan, use_varlen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
LENGTHS = [37, 1, 128, 64, 64, 5, 300]
TOLERANCES = {torch.float32: (1e-5, 1.3e-6), torch.float16: (2e-3, 1e-3)}
TOLERANCES[torch.bfloat16] = (1.6e-2, 1e-2)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_varlen_kernel_matches_pytorch_and_is_batch_invariant(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    model = model_from_state_dict(module_config(module), module_state(module), "cuda", dtype)
    module = module.to(device="cuda", dtype=dtype)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], 256, device="cuda", dtype=dtype)
    assert use_varlen(model.attn, x, make_plan(LENGTHS, device="cuda"))
    packed = model.forward_packed(x, cu)
    atol, rtol = TOLERANCES[dtype]
    for i, n in enumerate(LENGTHS):
        seq = x[cu[i] : cu[i + 1]]
        alone = model.forward_packed(seq, [0, n])
        assert torch.equal(alone, packed[cu[i] : cu[i + 1]]), f"sequence {i} depends on its batch"
        with torch.inference_mode():
            want = module(seq[None], seq[None], seq[None], need_weights=False)[0][0]
        torch.testing.assert_close(alone, want, atol=atol, rtol=rtol)
