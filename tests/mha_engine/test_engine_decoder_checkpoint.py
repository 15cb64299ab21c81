"""Decoder checkpoints: save_model/load_model with safetensors or weights_only torch.save files,
PyTorch's key names and hyper-parameters, and errors naming the bad field or key."""

from __future__ import annotations

import json

import pytest
import torch
from decoder_helpers import make_decoder, make_transformer
from torch import nn

from mha_engine import CheckpointError, load_model, save_model

D, H = 16, 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_decoder(D, H, num_layers=2, final_norm=True, activation="gelu"),
        lambda: make_decoder(D, H, norm_first=True, bias=False).layers[0],
        lambda: make_transformer(D, H, 1, 2, norm_first=True),
    ],
    ids=["decoder", "lone_layer", "transformer"],
)
def test_save_load_round_trip_is_bit_exact(tmp_path, make):
    module = make()
    save_model(module, tmp_path / "m")
    model = load_model(tmp_path / "m", device="cpu")
    again = tmp_path / "again"
    save_model(model, again)  # a loaded model saves back to the same files
    assert json.loads((again / "config.json").read_text()) == json.loads(
        (tmp_path / "m" / "config.json").read_text()
    )
    reloaded = load_model(again, device="cpu")
    a, b = torch.randn(2, 5, D), torch.randn(2, 7, D)
    args = (b, a) if isinstance(module, nn.Transformer) else (a, b)
    torch.testing.assert_close(reloaded(*args), model(*args), atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), module(*args), atol=1e-5, rtol=1.3e-6)


def test_config_uses_pytorch_names_and_defaults(tmp_path):
    save_model(make_transformer(D, H, 2, 3, 40, activation="gelu"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {
        "architecture": "transformer",
        "d_model": D,
        "nhead": H,
        "dim_feedforward": 40,
        "num_encoder_layers": 2,
        "num_decoder_layers": 3,
        "activation": "gelu",
        "layer_norm_eps": 1e-5,
        "norm_first": False,
        "bias": True,
    }
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(make_transformer(D, H, 2, 3, 40).state_dict())


def test_weights_only_torch_save_of_pytorch_state_dict(tmp_path):
    dec = make_decoder(D, H, num_layers=2, final_norm=True)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architecture": "transformer_decoder",
                "d_model": D,
                "nhead": H,
                "dim_feedforward": 32,
                "num_layers": 2,
                "final_norm": True,
            }
        )
    )
    torch.save(dec.state_dict(), tmp_path / "model.pt")
    model = load_model(tmp_path, device="cpu")
    x, mem = torch.randn(2, 5, D), torch.randn(2, 3, D)
    with torch.no_grad():
        torch.testing.assert_close(model(x, mem), dec(x, mem), atol=1e-5, rtol=1.3e-6)


def _write(tmp_path, config: dict, state: dict) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))


def test_bad_checkpoints_name_what_is_wrong(tmp_path):
    dec = make_decoder(D, H, num_layers=2)
    config = {
        "architecture": "transformer_decoder",
        "d_model": D,
        "nhead": H,
        "dim_feedforward": 32,
        "num_layers": 2,
    }
    state = dict(dec.state_dict())
    missing = {k: v for k, v in state.items() if k != "layers.1.multihead_attn.in_proj_weight"}
    _write(tmp_path, config, missing)
    with pytest.raises(CheckpointError, match=r"layers\.1\.multihead_attn\.in_proj_weight"):
        load_model(tmp_path, device="cpu")
    wrong = dict(state, **{"layers.0.norm3.weight": torch.ones(D + 1)})
    _write(tmp_path, config, wrong)
    with pytest.raises(CheckpointError, match=r"layers\.0\.norm3\.weight.*expected shape"):
        load_model(tmp_path, device="cpu")
    _write(tmp_path, dict(config, num_layers=3), state)
    with pytest.raises(CheckpointError, match=r"missing keys \['layers\.2\."):
        load_model(tmp_path, device="cpu")
    _write(tmp_path, dict(config, activation="swish"), state)
    with pytest.raises(CheckpointError, match="activation"):
        load_model(tmp_path, device="cpu")
    t_config = {
        "architecture": "transformer",
        "d_model": D,
        "nhead": H,
        "dim_feedforward": 32,
        "num_encoder_layers": 0,
    }
    _write(tmp_path, t_config, state)
    with pytest.raises(CheckpointError, match="num_encoder_layers"):
        load_model(tmp_path, device="cpu")
    _write(tmp_path, {**t_config, "num_encoder_layers": 1, "num_decoder_layers": 2}, state)
    with pytest.raises(CheckpointError, match=r"missing keys \['decoder\.layers\.0"):
        load_model(tmp_path, device="cpu")


def test_pickled_objects_are_refused(tmp_path):
    dec = make_decoder(D, H)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architecture": "transformer_decoder", "d_model": D, "nhead": H, "dim_feedforward": 32}
        )
    )
    torch.save({"state": dec.state_dict(), "module": dec}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_model(tmp_path, device="cpu")
