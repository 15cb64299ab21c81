"""The engine's CUDA routes on a real GPU (skipped without one, saying why): the flash (fp16/bf16)
and memory-efficient (fp32) varlen kernels against nn.MultiheadAttention per sequence, batch
invariance (a sequence alone or packed with others), and CUDA-graph replay against the eager
forward. Run on an H100 (torch 2.11, CUDA 13): fp16/bf16 are bit-exact batch invariant eagerly and
graphed; fp32 is not, because cuBLAS's fp32 GEMM picks kernels by row count (a 1- or 5-row
sequence alone differs by up to 1.5e-6 from the same rows in a 600-row GEMM): within FP32_DRIFT."""

from __future__ import annotations

import pytest
import torch

from mha_engine.checkpoint import model_from_state_dict
from mha_engine.packed_attention import use_varlen
from mha_engine.save import module_config, module_state
from mha_engine.varlen import cumulative, make_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
LENGTHS = [37, 1, 128, 64, 64, 5, 300]
TOLERANCES = {torch.float32: (1e-5, 1.3e-6), torch.float16: (2e-3, 1e-3)}
TOLERANCES[torch.bfloat16] = (1.6e-2, 1e-2)
FP32_DRIFT = 4e-6  # measured 1.5e-6 (GEMM) / 7e-7 (whole block) on an H100


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Bit-exact in the half precisions; within FP32_DRIFT in float32 (see the docstring)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=FP32_DRIFT, rtol=0, msg=what)
    else:
        assert torch.equal(a, b), what


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
        _same(alone, packed[cu[i] : cu[i + 1]], dtype, f"sequence {i} depends on its batch")
        with torch.inference_mode():
            want = module(seq[None], seq[None], seq[None], need_weights=False)[0][0]
        torch.testing.assert_close(alone, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_cuda_graph_replay_gives_the_eager_numbers(dtype):
    """A graphed model replays unmasked packed batches, causal or not, with exactly the eager
    forward's numbers, a sequence alone or with batch-mates; masked calls, mixed causal flags
    and batches past the buckets run eagerly; the graphs are bounded and their memory
    counted."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    eager = model_from_state_dict(module_config(module), module_state(module), "cuda", dtype)
    graphed = model_from_state_dict(module_config(module), module_state(module), "cuda", dtype)
    graphs = graphed.enable_cuda_graphs(max_tokens=1024, max_graphs=40, warm_max_len=512)
    assert 0 < graphs.count <= 40 and graphs.memory_bytes > 0
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], 256, device="cuda", dtype=dtype)
    replays = graphs.replays
    packed = graphed.forward_packed(x, cu)
    assert graphs.replays == replays + 1
    assert torch.equal(packed, eager.forward_packed(x, cu)), "graph replay != eager forward"
    for i, n in enumerate(LENGTHS):
        alone = graphed.forward_packed(x[cu[i] : cu[i + 1]], [0, n])
        _same(alone, packed[cu[i] : cu[i + 1]], dtype, f"graphed sequence {i} depends on its batch")
    replays = graphs.replays
    mask = torch.zeros(cu[-1], dtype=torch.bool, device="cuda")
    mask[3] = True
    masked = graphed.forward_packed(x, cu, key_padding_mask=mask)
    assert torch.equal(masked, eager.forward_packed(x, cu, key_padding_mask=mask))
    big = torch.randn(2000, 256, device="cuda", dtype=dtype)
    assert torch.equal(
        graphed.forward_packed(big, [0, 1000, 2000]), eager.forward_packed(big, [0, 1000, 2000])
    )
    assert graphs.replays == replays  # neither replayed
    count = graphs.count
    causal = graphed.forward_packed(x, cu, is_causal=True)  # its own graph, captured now
    assert graphs.replays == replays + 1 and graphs.count == count + 1
    # fp32 within FP32_DRIFT: a 1024-row bucket's GEMMs against 599 rows eagerly (the plain
    # graph's equality above held on an H100; this causal one has not run on a GPU yet)
    _same(causal, eager.forward_packed(x, cu, is_causal=True), dtype, "causal replay != eager")
    for i, n in enumerate(LENGTHS):
        alone = graphed.forward_packed(x[cu[i] : cu[i + 1]], [0, n], is_causal=True)
        _same(alone, causal[cu[i] : cu[i + 1]], dtype, f"causal sequence {i} depends on its batch")
    mixed = [True, False] * 3 + [True]
    assert torch.equal(
        graphed.forward_packed(x, cu, is_causal=mixed), eager.forward_packed(x, cu, is_causal=mixed)
    )


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_cross_attention_graphs_give_the_eager_numbers(dtype):
    """Cross-attention replays give the eager forward's numbers, a pair alone or batched: an
    attention block with its own key and value, and a decoder stack (causal self-attention,
    then cross-attention), each bucket captured on first use."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    k_lens = [11, 300, 2, 64, 17, 90, 5]
    cu_q, cu_k = cumulative(LENGTHS), cumulative(k_lens)
    x = torch.randn(cu_q[-1], 256, device="cuda", dtype=dtype)
    key, value = (torch.randn(cu_k[-1], 256, device="cuda", dtype=dtype) for _ in "kv")
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    decoder_layer = torch.nn.TransformerDecoderLayer(256, 8, 512, 0.0, batch_first=True)
    decoder = torch.nn.TransformerDecoder(decoder_layer, 2).eval()
    for source, call in ((module, _block_cross), (decoder, _decoder_cross)):
        eager = model_from_state_dict(module_config(source), module_state(source), "cuda", dtype)
        graphed = model_from_state_dict(module_config(source), module_state(source), "cuda", dtype)
        graphs = graphed.enable_cuda_graphs(max_tokens=1024, max_graphs=16, warm_max_len=16)
        replays = graphs.replays
        got = call(graphed, x, cu_q, key, value, cu_k)
        assert graphs.replays == replays + 1, "no cross-attention replay"
        _same(got, call(eager, x, cu_q, key, value, cu_k), dtype, "graph replay != eager")
        for i, n in enumerate(LENGTHS):
            q, k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            alone = call(graphed, x[q], [0, n], key[k], value[k], [0, k_lens[i]])
            _same(alone, got[q], dtype, f"graphed pair {i} depends on its batch")


def _block_cross(model, x, cu, key, value, cu_k):
    return model.forward_packed(x, cu, key, value, cu_k)  # own key and value


def _decoder_cross(model, x, cu, memory, _value, cu_memory):
    return model.forward_packed(x, cu, memory, cu_memory, tgt_is_causal=True)


def test_two_models_capturing_on_their_own_threads_replay_their_own_numbers():
    """Two graphed models serving on two threads capture causal buckets on first use at the
    same time (PyTorch allows one capture per process: they take turns); each replays its own
    eager numbers, nothing fails to capture, and each thread is left on its default stream
    (the current stream is per thread: checked in each)."""
    import threading

    torch.manual_seed(0)
    modules = [torch.nn.MultiheadAttention(256, 8, batch_first=True).eval() for _ in range(2)]

    def build(module, graphs: bool):
        model = model_from_state_dict(
            module_config(module), module_state(module), "cuda", torch.float16
        )
        if graphs:  # nothing causal warmed: every causal bucket is captured on first use
            model.enable_cuda_graphs(max_tokens=256, max_graphs=64, warm_max_len=16)
        return model

    graphed = [build(m, True) for m in modules]
    eager = [build(m, False) for m in modules]
    lens = [[37, 1, 64, 5], [100, 20, 3], [9, 9, 9, 9, 9], [120, 7]]
    xs = [torch.randn(sum(n), 256, device="cuda", dtype=torch.float16) for n in lens]
    errors: list[str] = []

    def serve(i: int) -> None:
        try:
            for x, n in zip(xs, lens, strict=True):
                got = graphed[i].forward_packed(x, cumulative(n), is_causal=True)
                want = eager[i].forward_packed(x, cumulative(n), is_causal=True)
                if not torch.equal(got, want):
                    errors.append(f"model {i}, lengths {n}: not the eager numbers")
            if torch.cuda.current_stream() != torch.cuda.default_stream():
                errors.append(f"model {i}: its thread was left on another stream")
        except Exception as exc:  # reported below with the thread's model
            errors.append(f"model {i}: {exc!r}")

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert errors == []
    assert [sorted(g.cuda_graphs.failed) for g in graphed] == [[], []]
    assert all(g.cuda_graphs.replays >= len(lens) for g in graphed)


def test_text_model_replays_its_encoder():
    """MiniLM's shape in fp16: encode_packed graphed equals eager, bit for bit."""
    import mha_engine
    from service.text.tokenizer import minilm_path

    path = minilm_path()
    if path is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (or MHA_MINILM_DIR unset)")
    eager = mha_engine.load_model(path, device="cuda", dtype="float16")
    graphed = mha_engine.load_model(path, device="cuda", dtype="float16")
    graphs = graphed.enable_cuda_graphs(max_tokens=2048, warm_max_len=256)
    lens = [37, 1, 128, 64, 5, 256]
    ids = torch.randint(1000, 20000, (sum(lens),))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    replays = graphs.replays
    got = graphed.encode_packed(ids, cu)
    assert graphs.replays == replays + 1
    assert torch.equal(got, eager.encode_packed(ids, cu))
    vectors = graphed.embed_packed(ids, cu)  # mean pooling: deterministic on CUDA too
    assert torch.equal(vectors, eager.embed_packed(ids, cu))
    for i, n in enumerate(lens):  # a sentence's vector does not depend on its batch-mates
        alone = eager.embed_packed(ids[cu[i] : cu[i + 1]], [0, n])
        assert torch.equal(alone[0], vectors[i]), f"sentence {i} depends on its batch"


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_causal_cross_and_gqa_take_the_varlen_kernel(dtype):
    """Causal self-attention and cross-attention (keys of other lengths) run one varlen call and
    match nn.MultiheadAttention per sequence; GQA in fp16/bf16 matches the grouped path; a masked
    batch takes the groups and is counted."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    model = model_from_state_dict(module_config(module), module_state(module), "cuda", dtype)
    module = module.to(device="cuda", dtype=dtype)
    atol, rtol = TOLERANCES[dtype]
    kv_lens = [12, 40, 3, 64, 64, 9, 100]
    cu, cu_k = [0], [0]
    for n, m in zip(LENGTHS, kv_lens, strict=True):
        cu.append(cu[-1] + n)
        cu_k.append(cu_k[-1] + m)
    x = torch.randn(cu[-1], 256, device="cuda", dtype=dtype)
    mem = torch.randn(cu_k[-1], 256, device="cuda", dtype=dtype)
    grouped = model.cuda_grouped_calls
    causal = model.forward_packed(x, cu, is_causal=True)
    cross = model.forward_packed(x, cu, mem, mem, cu_k)
    assert model.cuda_grouped_calls == grouped  # both through the kernel
    for i, n in enumerate(LENGTHS):
        seq, keys = x[cu[i] : cu[i + 1]][None], mem[cu_k[i] : cu_k[i + 1]][None]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, "cuda", dtype)
        with torch.inference_mode():
            want = module(seq, seq, seq, attn_mask=mask, need_weights=False, is_causal=True)[0]
            want_x = module(seq, keys, keys, need_weights=False)[0]
        torch.testing.assert_close(causal[cu[i] : cu[i + 1]], want[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(cross[cu[i] : cu[i + 1]], want_x[0], atol=atol, rtol=rtol)
        alone = model.forward_packed(x[cu[i] : cu[i + 1]], [0, n], is_causal=True)
        _same(alone, causal[cu[i] : cu[i + 1]], dtype, f"causal sequence {i} depends on its batch")
    kpm = torch.zeros(cu[-1], dtype=torch.bool, device="cuda")
    kpm[0] = True
    model.forward_packed(x, cu, key_padding_mask=kpm)
    assert model.cuda_grouped_calls == grouped + 1  # counted for /metrics
    if dtype == torch.float32:
        return
    config = {**module_config(module), "num_kv_heads": 2}
    state = {k: v.clone() for k, v in module_state(module).items()}
    state["in_proj_weight"] = state["in_proj_weight"][: 256 + 2 * 64]
    state["in_proj_bias"] = state["in_proj_bias"][: 256 + 2 * 64]
    gqa = model_from_state_dict(config, state, "cuda", dtype)
    got = gqa.forward_packed(x, cu)
    assert gqa.cuda_grouped_calls == 0
    cpu = model_from_state_dict(config, state, "cpu", "float32")  # grouped SDPA on CPU
    want = cpu.forward_packed(x.float().cpu(), cu)
    torch.testing.assert_close(got.float().cpu(), want, atol=atol * 4, rtol=rtol * 4)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_overlapped_batches_give_each_request_its_numbers_alone(dtype, graphs):
    """--cuda-overlap (copies on their own streams, batches finished on a second thread, two in
    flight): 200 requests of mixed lengths through the real batcher; each request's output
    equals its sequence's forward alone (bit-exact in fp16; fp32 within FP32_DRIFT). A
    stream-ordering fault (an output read before its copy, an input buffer reused early)
    shows here as a wrong request."""
    import asyncio
    import time

    import numpy as np

    from service.oip.inputs import Payload
    from service.runtime.batcher import DynamicBatcher
    from service.runtime.forward import hidden_states
    from service.runtime.work import Work

    torch.manual_seed(1)
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    model = model_from_state_dict(module_config(module), module_state(module), "cuda", dtype)
    if graphs:
        model.enable_cuda_graphs(max_tokens=1024, max_sequences=16, warm_max_len=64)
    rng = np.random.default_rng(2)
    inputs = [
        rng.standard_normal((int(n), 256)).astype(np.float32) for n in rng.integers(1, 64, 200)
    ]
    batcher = DynamicBatcher(
        model,
        max_batch_size=16,
        max_batch_tokens=1024,
        max_batch_delay_s=0.0,
        max_queue=512,
        overlap=True,
    )

    async def run() -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        works = [
            Work(
                payload=Payload(x, [len(x)]),
                runner=hidden_states,
                deadline=time.monotonic() + 60,
                loop=loop,
            )
            for x in inputs
        ]
        for work in works:
            batcher.submit(work)
        return await asyncio.gather(*(w.future for w in works))

    batcher.start()
    try:
        results = asyncio.run(run())
    finally:
        batcher.stop(timeout=60)
    for i, (x, got) in enumerate(zip(inputs, results, strict=True)):
        seq = torch.from_numpy(x).to(device="cuda", dtype=dtype)
        alone = model.forward_packed(seq, [0, len(x)]).float().cpu()
        _same(
            torch.from_numpy(np.asarray(got)),
            alone,
            torch.float16 if dtype == torch.float16 else dtype,
            f"request {i}",
        )
