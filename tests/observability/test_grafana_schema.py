"""The Grafana dashboard type-checks against Grafana's own published `Dashboard` type.

No Grafana here to load it into, so `tsc --strict` checks deploy/grafana/dashboards/*.json as a
literal of `@grafana/schema`'s Dashboard (pinned in grafana_schema/package-lock.json): misspelt
keys, wrong enum values and wrong types fail. A deliberately broken copy proves the check bites.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = Path(__file__).parent / "grafana_schema"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

# JSON cannot hold TypeScript enum members, so string enums are checked as their string values.
PRELUDE = """import type { Dashboard } from "@grafana/schema";
type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;
"""


def _installed() -> bool:
    """node_modules matches package-lock.json (npm keeps a copy of what it installed)."""
    hidden = PACKAGE / "node_modules" / ".package-lock.json"
    if not hidden.exists() or not (PACKAGE / "node_modules" / ".bin" / "tsc").exists():
        return False
    locked = json.loads((PACKAGE / "package-lock.json").read_text())["packages"]
    installed = json.loads(hidden.read_text())["packages"]
    return {k: v.get("version") for k, v in locked.items() if k} == {
        k: v.get("version") for k, v in installed.items()
    }


@pytest.fixture(scope="module")
def tsc() -> Path:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node/npm not installed: the Grafana dashboard type check needs them")
    if not _installed():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=PACKAGE,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (offline registry?): {done.stderr.strip()[-400:]}")
    return PACKAGE / "node_modules" / ".bin" / "tsc"


def _check(tsc: Path, work: Path, dashboard: dict) -> subprocess.CompletedProcess:
    """tsc --strict on `const d: Json<Dashboard> = <dashboard>` in `work`."""
    (work / "node_modules").symlink_to(PACKAGE / "node_modules")
    shutil.copy(PACKAGE / "tsconfig.json", work / "tsconfig.json")
    source = (
        PRELUDE + f"export const dashboard: Json<Dashboard> = {json.dumps(dashboard, indent=2)};\n"
    )
    (work / "dashboard.ts").write_text(source)
    return subprocess.run(
        [str(tsc), "-p", "tsconfig.json"], cwd=work, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_matches_grafana_types(tsc: Path, path: Path, tmp_path: Path) -> None:
    done = _check(tsc, tmp_path, json.loads(path.read_text()))
    assert done.returncode == 0, done.stdout + done.stderr


def _height_as_text(d: dict) -> None:
    _panel(d)["gridPos"]["h"] = "eight"


def _unknown_threshold_mode(d: dict) -> None:
    _panel(d)["fieldConfig"]["defaults"]["thresholds"] = {"mode": "relative-ish", "steps": []}


def _misspelt_key(d: dict) -> None:
    d["refreshh"] = d.pop("refresh")


def _panel(d: dict) -> dict:
    return next(p for p in d["panels"] if "fieldConfig" in p)


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (_height_as_text, "not assignable to type 'number'"),
        (_unknown_threshold_mode, "relative-ish"),
        (_misspelt_key, "refreshh"),
    ],
)
def test_a_broken_dashboard_fails_the_check(tsc: Path, tmp_path: Path, breakage, expected) -> None:
    broken = json.loads(DASHBOARDS[0].read_text())
    breakage(broken)
    done = _check(tsc, tmp_path, broken)
    assert done.returncode != 0 and expected in done.stdout, done.stdout
