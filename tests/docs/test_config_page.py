"""docs/configuration.md is what tools/config_page.py generates from the Settings model."""

from __future__ import annotations

import re
import runpy
from types import SimpleNamespace

from tests.support import ROOT


def _generator() -> SimpleNamespace:
    """tools/config_page.py's functions (run as a module, not as the script)."""
    return SimpleNamespace(**runpy.run_path(str(ROOT / "tools" / "config_page.py")))


def _sections(page: str) -> dict[str, str]:
    """Each option's section, keyed by its flag as the heading spells it."""
    parts = re.split(r"^### ", page, flags=re.M)[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


def test_committed_page_is_what_the_settings_generate() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == _generator().render(), (
        "docs/configuration.md is stale: run `python tools/config_page.py` and commit"
    )


def test_every_setting_has_its_flag_env_var_and_description() -> None:
    from service.runtime.settings import Settings

    sections = _sections(_generator().render())
    assert len(sections) == len(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        flag = f"`--{name.replace('_', '-')}`"
        section = next((s for heading, s in sections.items() if heading.startswith(flag)), None)
        assert section is not None, f"{flag} has no section"
        assert f"`MHA_{name.upper()}`" in section
        assert field.description and field.description.split()[-1] in section


def test_bounds_and_defaults_are_the_models() -> None:
    sections = _sections(_generator().render())
    assert "default `8000` · ≥ 0, ≤ 65535" in sections["`--port`"]
    assert "default 67108864 (64 MiB) · ≥ 1024" in sections["`--max-body-bytes`"]
    assert "default on" in sections["`--access-log-probes`, `--no-access-log-probes`"]
    assert "`float32` | `bfloat16` | `float16` | `int8`" in sections["`--dtype`"]
