"""Which models the server loads: --model-dir (repeatable) and a Triton-style --model-repository.

A repository holds DIR/<model>/<version>/, each version directory a model directory as
--model-dir takes it (config.json + weights, or a Hugging Face BERT-family directory); a model
is served at its highest numeric version (Triton's default policy, latest 1). An optional
DIR/<model>/mha-serve.json sets that model's own batching limits, dtype and device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.settings import Settings

DEMO_NAME = "mha"
SETTINGS_FILE = "mha-serve.json"
# What a model's settings file may set (the server's flags of the same names otherwise).
MODEL_SETTINGS = frozenset(
    {"max_batch_size", "max_batch_tokens", "max_batch_delay_ms", "max_queue", "max_seq_len",
     "dtype", "device"}
)  # fmt: skip
LATEST_ONE = {"latest": {"num_versions": 1}}


class RepositoryError(ValueError):
    """The model sources cannot be served as configured; the message names the path or flag."""


@dataclass(frozen=True)
class ModelSource:
    """One model to load: its name in URLs, directory (None: the demo model) and version."""

    name: str
    path: Path | None
    version: str = "1"
    overrides: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def _read_overrides(model: Path) -> dict[str, Any]:
    """DIR/<model>/mha-serve.json as a dict of settings; RepositoryError naming what is wrong."""
    path = model / SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise RepositoryError(f"{path} must hold a JSON object")
    policy = values.pop("version_policy", LATEST_ONE)
    if policy != LATEST_ONE:
        raise RepositoryError(
            f"{path}: version_policy {json.dumps(policy)} is not supported; only "
            f"{json.dumps(LATEST_ONE)} (the highest version is served)"
        )
    unknown = sorted(set(values) - MODEL_SETTINGS)
    if unknown:
        raise RepositoryError(
            f"{path}: unknown setting(s) {unknown}; allowed: {sorted(MODEL_SETTINGS)}"
        )
    return values


def model_settings(settings: Settings, source: ModelSource) -> Settings:
    """The server's settings with the model's own settings file applied (validated alike)."""
    if not source.overrides:
        return settings
    try:
        return type(settings)(**{**settings.model_dump(), **source.overrides})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise RepositoryError(f"model '{source.name}' {SETTINGS_FILE}: {problems}") from None


def repository_models(root: Path) -> list[ModelSource]:
    """Every model of a repository at its highest version, by name."""
    if not root.is_dir():
        raise RepositoryError(f"--model-repository {root} is not a directory")
    sources = []
    for model in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = [int(v.name) for v in model.iterdir() if v.is_dir() and v.name.isdigit()]
        if not versions:
            raise RepositoryError(
                f"model '{model.name}' in {root} has no version directory "
                f"(expected {model}/<version>/ with config.json, e.g. {model}/1/)"
            )
        latest = max(versions)
        overrides = _read_overrides(model)
        sources.append(ModelSource(model.name, model / str(latest), str(latest), overrides))
    return sources


def model_sources(settings: Settings) -> list[ModelSource]:
    """The models to serve, in order (the first is the default for single-model routes)."""
    sources = [ModelSource(Path(path).resolve().name, Path(path)) for path in settings.model_dir]
    if settings.model_repository is not None:
        sources += repository_models(settings.model_repository)
    for source in sources:
        model_settings(settings, source)  # a bad settings file stops the server at start
    if settings.model_name:
        if len(sources) > 1:
            raise RepositoryError("--model-name names one model; it cannot name several")
        path = sources[0].path if sources else None
        version = sources[0].version if sources else "1"
        overrides = sources[0].overrides if sources else {}
        return [ModelSource(settings.model_name, path, version, overrides)]
    if not sources:
        if settings.model_repository is not None:
            raise RepositoryError(f"--model-repository {settings.model_repository} holds no model")
        return [ModelSource(DEMO_NAME, None)]
    names = [source.name for source in sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RepositoryError(
            f"two models would be served as {', '.join(duplicates)}; model names must be unique"
        )
    return sources
