"""Prebuilt C kernels (tools/build_kernels.py -> mha_engine/prebuilt/): built for every level,
the one for this CPU loaded in place of a compile, with the same numbers; a missing or broken
one falls back to compiling."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mha_engine import cbuild, cpu_varlen, int8_rows
from tools.build_kernels import KERNELS, build_all

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("prebuilt")
    written = build_all(dest, ["cc"])
    assert sorted(p.name for p in written) == sorted(
        f"{kernel.source.stem}-{name.lower()}.so"
        for kernel in KERNELS
        for name in cbuild.prebuilt_levels()
    )
    return dest


def test_the_library_for_this_cpu_is_loaded_instead_of_a_compile(prebuilt, monkeypatch):
    monkeypatch.setattr(cbuild, "PREBUILT", prebuilt)
    monkeypatch.setenv("CC", "false")  # a compile would fail: only the prebuilt one can load
    rows, status = int8_rows.KERNEL.compile()
    assert status == f"prebuilt (int8_rows-{cbuild.level().lower()}.so)"
    x = torch.randn(40, 384) * 3
    q, scale, mid = torch.empty(40, 384, dtype=torch.uint8), torch.empty(40), torch.empty(40)
    rows.quantize_rows(x.data_ptr(), 40, 384, 384, 127, q.data_ptr(), scale.data_ptr(),
                       mid.data_ptr(), 1)  # fmt: skip
    want = int8_rows._quantize_rows_eager(x, 127)
    assert torch.equal(q, want[0]) and torch.equal(scale, want[1]) and torch.equal(mid, want[2])


def test_the_prebuilt_attention_kernel_gives_sdpas_numbers(prebuilt, monkeypatch):
    monkeypatch.setattr(cbuild, "PREBUILT", prebuilt)
    kernel, status = cpu_varlen.KERNEL.compile()
    assert status.startswith("prebuilt (cpu_varlen-")
    H, D, lens = 4, 16, [3, 9]
    qkv = torch.randn(sum(lens), 3 * H * D)
    out = torch.empty(sum(lens), H * D)
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    modes = torch.ones(2, dtype=torch.uint8)
    q, k, v = qkv.split(H * D, dim=1)
    kernel.attention(q.data_ptr(), 3 * H * D, k.data_ptr(), 3 * H * D, v.data_ptr(), 3 * H * D,
                     out.data_ptr(), H * D, cu.data_ptr(), cu.data_ptr(), 2, H, H, D, D**-0.5,
                     modes.data_ptr(), 0, 1, 9)  # fmt: skip
    for a, b in ((0, 3), (3, 12)):
        heads = [t[a:b].view(1, b - a, H, D).transpose(1, 2) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b - a, H * D)
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1.3e-6)


def test_a_missing_or_broken_prebuilt_library_falls_back_to_compiling(tmp_path, monkeypatch):
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path)
    lib, status = cbuild.build(cpu_varlen.SOURCE, cpu_varlen.FLAGS)
    assert isinstance(lib, ctypes.CDLL) and status.startswith("compiled (")
    cbuild.prebuilt_path(cpu_varlen.SOURCE, tmp_path).write_bytes(b"not a library")
    lib, status = cbuild.build(cpu_varlen.SOURCE, cpu_varlen.FLAGS)
    assert isinstance(lib, ctypes.CDLL) and status.startswith("compiled (")


def test_the_build_tool_says_why_it_failed(tmp_path):
    with pytest.raises(RuntimeError, match=r"int8_rows\.c for"):
        build_all(tmp_path, ["false"])


def test_a_kernel_that_cannot_build_warns_once_and_its_switch_turns_it_off(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path)  # nothing prebuilt: it must compile
    monkeypatch.setenv("CC", "false")
    kernel = cbuild.Kernel(
        "test kernel", cpu_varlen.SOURCE, cpu_varlen.FLAGS, cpu_varlen._Library,
        switch="MHA_TEST_KERNEL", off="no", fallback="the eager path instead",
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="mha_engine.cbuild"):
        assert kernel.library() is None and kernel.library() is None
    assert kernel.status().startswith("eager: false failed to build cpu_varlen.c")
    assert [r.getMessage() for r in caplog.records] == [
        f"test kernel: {kernel.status()} (the eager path instead)"
    ]
    monkeypatch.setenv("MHA_TEST_KERNEL", "no")
    assert kernel.status() == "eager: MHA_TEST_KERNEL=no"


def _attend(lib: cpu_varlen._Library, lens: list[int], causal: bool) -> torch.Tensor:
    H, D = 4, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(sum(lens), 3 * H * D, generator=g) * 2).split(H * D, dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    modes = torch.full((len(lens),), 1 + causal, dtype=torch.uint8)
    out = torch.empty(sum(lens), H * D)
    lib.attention(q.data_ptr(), 3 * H * D, k.data_ptr(), 3 * H * D, v.data_ptr(), 3 * H * D,
                  out.data_ptr(), H * D, cu.data_ptr(), cu.data_ptr(), len(lens), H, H, D,
                  D**-0.5, modes.data_ptr(), 0, 1, max(lens))  # fmt: skip
    return out


@pytest.mark.skipif(
    cbuild.level() not in ("AVX2", "AVX512"), reason="needs a CPU that runs x86-64-v3 code"
)
@pytest.mark.parametrize("causal", [False, True])
def test_the_avx2_and_native_attention_builds_give_the_same_bits(prebuilt, causal):
    """cpu_varlen.c's vectors follow the target's register width (8 floats for AVX2, 16 for
    AVX-512) and every sum keeps its order, so the x86-64-v3 library and this CPU's own build
    agree bit for bit."""
    avx2 = cpu_varlen._Library(
        ctypes.CDLL(str(cbuild.prebuilt_path(cpu_varlen.SOURCE, prebuilt, "AVX2")))
    )
    native, status = cpu_varlen.KERNEL.loaded()
    assert native is not None, status
    lens = [1, 5, 17, 33, 64, 3, 16, 40]
    assert torch.equal(_attend(avx2, lens, causal), _attend(native, lens, causal))


def test_a_compiled_library_is_kept_for_the_next_process(tmp_path, monkeypatch):
    """Compiled once into the cache (0700 directory, 0600 file); the next build loads it
    (same code: same numbers); a changed flag is another key; a broken entry is rebuilt."""
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path / "none")
    cache = tmp_path / "cache"
    monkeypatch.setenv(cbuild.CACHE_ENV, str(cache))
    lib, status = cbuild.build(cpu_varlen.SOURCE, cpu_varlen.FLAGS, (cbuild.OPENMP, ()))
    assert lib is not None and not status.endswith("; cached)"), status
    (kept,) = cache.iterdir()
    assert cache.stat().st_mode & 0o777 == 0o700 and kept.stat().st_mode & 0o777 == 0o600
    cached, again = cbuild.build(cpu_varlen.SOURCE, cpu_varlen.FLAGS, (cbuild.OPENMP, ()))
    assert cached is not None and again == status.removesuffix(")") + "; cached)"
    assert str(kept) in Path("/proc/self/maps").read_text()  # mapped from the cache itself
    lens = [1, 7, 30]
    want = _attend(cpu_varlen._Library(lib), lens, causal=True)
    assert torch.equal(_attend(cpu_varlen._Library(cached), lens, causal=True), want)
    kept.unlink()  # (a mapped file is replaced, never written over)
    kept.write_bytes(b"not a library")
    kept.chmod(0o600)
    build = (
        "from mha_engine import cbuild as c, cpu_varlen as v\n"
        f"c.PREBUILT = c.Path({str(tmp_path / 'none')!r})\n"
        "print(c.build(v.SOURCE, v.FLAGS, (c.OPENMP, ()))[1])"
    )
    # another process: this one's loader would hand back the library it already mapped
    done = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == status  # compiled, not loaded from the broken entry
    assert kept.read_bytes()[:4] == b"\x7fELF"  # which the new build replaced
    cbuild.build(cpu_varlen.SOURCE, [*cpu_varlen.FLAGS, "-DMHA_TEST_FLAG=1"], ((),))
    assert len(list(cache.iterdir())) == 2


def test_a_cache_others_can_write_is_not_used(tmp_path, monkeypatch):
    """A library loaded from the cache runs in this process: a directory another user could
    write is ignored (compiled as if there were none), as is "off"."""
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path / "none")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(cbuild.CACHE_ENV, str(shared))
    assert cbuild.cache_dir() is None
    lib, status = cbuild.build(int8_rows.SOURCE, int8_rows.FLAGS)
    assert lib is not None and status.startswith("compiled (") and not list(shared.iterdir())
    monkeypatch.setenv(cbuild.CACHE_ENV, "off")
    assert cbuild.cache_dir() is None
    monkeypatch.delenv(cbuild.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cbuild.cache_dir() == tmp_path / "xdg" / "mha-engine"
