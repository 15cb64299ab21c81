"""Which models the server loads: --model-dir (repeatable) and a Triton-style --model-repository.

A repository holds DIR/<model>/<version>/, each version directory a model directory as
--model-dir takes it (config.json + weights, or a Hugging Face BERT-family directory); a model
is served at its highest numeric version (Triton's default policy, latest 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.settings import Settings

DEMO_NAME = "mha"


class RepositoryError(ValueError):
    """The model sources cannot be served as configured; the message names the path or flag."""


@dataclass(frozen=True)
class ModelSource:
    """One model to load: its name in URLs, directory (None: the demo model) and version."""

    name: str
    path: Path | None
    version: str = "1"


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
        sources.append(ModelSource(model.name, model / str(latest), str(latest)))
    return sources


def model_sources(settings: Settings) -> list[ModelSource]:
    """The models to serve, in order (the first is the default for single-model routes)."""
    sources = [ModelSource(Path(path).resolve().name, Path(path)) for path in settings.model_dir]
    if settings.model_repository is not None:
        sources += repository_models(settings.model_repository)
    if settings.model_name:
        if len(sources) > 1:
            raise RepositoryError("--model-name names one model; it cannot name several")
        path = sources[0].path if sources else None
        version = sources[0].version if sources else "1"
        return [ModelSource(settings.model_name, path, version)]
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
