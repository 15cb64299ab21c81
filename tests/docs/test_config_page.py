"""docs/configuration.md is what tools/config_page.py generates from the Settings model."""

from __future__ import annotations

import importlib.util
import sys

from tests.support import ROOT


def _generator():
    spec = importlib.util.spec_from_file_location("config_page", ROOT / "tools" / "config_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("config_page", module)
    spec.loader.exec_module(module)
    return module


def test_committed_page_is_what_the_settings_generate() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == _generator().render(), (
        "docs/configuration.md is stale: run `python tools/config_page.py` and commit"
    )


def test_every_setting_has_its_flag_env_var_and_default() -> None:
    from service.settings import Settings

    page = _generator().render()
    for name, field in Settings.model_fields.items():
        flag = f"| `--{name.replace('_', '-')}`"
        row = next((line for line in page.splitlines() if line.startswith(flag)), None)
        assert row is not None, f"--{name} has no row"
        assert f"`MHA_{name.upper()}`" in row
        assert field.description and field.description.split()[0] in row


def test_bounds_and_defaults_are_the_models() -> None:
    page = _generator().render()
    port = next(line for line in page.splitlines() if line.startswith("| `--port`"))
    assert "`8000`" in port and "≥ 0, ≤ 65535" in port
    body = next(line for line in page.splitlines() if line.startswith("| `--max-body-bytes`"))
    assert "67108864 (64 MiB)" in body and "≥ 1024" in body
    probes = next(line for line in page.splitlines() if "`--access-log-probes`" in line)
    assert "`--no-access-log-probes`" in probes and "| on |" in probes
