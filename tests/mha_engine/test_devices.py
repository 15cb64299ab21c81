"""Device and dtype checks (mha_engine.devices): every CUDA branch run here with torch.cuda
patched, so a host without a GPU still executes them."""

from __future__ import annotations

import pytest
import torch

import mha_engine
from mha_engine import DeviceError, Int8Unsupported, check_device, devices, fused


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda as on a host with one GPU that has bf16 (an H100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_existing_cuda_device_passes(one_gpu, name):
    device, dtype, int8 = check_device(name, "float16")
    assert device == torch.device(name) and dtype == torch.float16 and not int8


def test_auto_device_is_cuda_where_available(one_gpu):
    assert check_device(None)[0] == torch.device("cuda")


def test_cuda_ordinal_past_the_host_devices(one_gpu):
    with pytest.raises(DeviceError, match=r"^cuda:7 does not exist: this host has 1 CUDA device"):
        check_device("cuda:7")


def test_bfloat16_on_a_gpu_without_it(one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    with pytest.raises(DeviceError, match=r"cuda \(Tesla V100\) cannot compute in bfloat16"):
        check_device("cuda", "bfloat16")


def test_int8_on_cuda_says_cpu_only(one_gpu):
    with pytest.raises(Int8Unsupported, match="CPU only") as info:
        check_device("cuda", "int8")
    assert isinstance(info.value, DeviceError)


def test_cuda_build_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(DeviceError, match=r"no CUDA device is visible.*CUDA_VISIBLE_DEVICES"):
        check_device("cuda")


def test_cpu_build_asked_for_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    asked = r"^cuda:1 was asked for, but this torch build .* no CUDA"
    with pytest.raises(DeviceError, match=asked):
        check_device("cuda:1")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("cudaX", "'cudaX' is not a device name; use cpu, cuda or cuda:N"),
        ("meta", "device type 'meta' is not supported"),
        ("", "'' is not a device name"),
    ],
)
def test_malformed_or_unsupported_device(name, message):
    with pytest.raises(DeviceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_device(name)


def test_unknown_dtype():
    with pytest.raises(DeviceError, match=r"unsupported dtype 'float64'"):
        check_device("cpu", "float64")


def test_building_a_model_raises_the_same_error():
    """The library's loaders check through check_device too."""
    with pytest.raises(DeviceError, match="'cudaX' is not a device name"):
        mha_engine.build_demo_model(device="cudaX")


def test_bf16_on_a_cpu_without_bf16_instructions_is_said_once(monkeypatch, caplog):
    """There bf16 is no faster than float32 (docs/engine-cpu.md): loading says so, once."""
    caplog.set_level("WARNING", logger="mha_engine.devices")
    monkeypatch.setattr(devices, "_slow_bf16_said", False)
    monkeypatch.setattr(fused, "NATIVE_BF16", True)
    devices.check_device("cpu", "bfloat16")
    assert not caplog.records
    monkeypatch.setattr(fused, "NATIVE_BF16", False)
    devices.check_device("cpu", "float32")
    assert not caplog.records
    devices.check_device("cpu", "bfloat16")
    devices.check_device("cpu", "bfloat16")
    (record,) = caplog.records
    assert "no faster than float32" in record.getMessage()
    assert fused.cpu_capability() in record.getMessage()
