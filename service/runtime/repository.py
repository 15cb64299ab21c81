"""Which models the server loads: --model-dir (repeatable) and a Triton-style --model-repository.

A repository holds DIR/<model>/<version>/, each version directory a model directory as
--model-dir takes it (config.json + weights, or a Hugging Face BERT-family directory). An
optional DIR/<model>/mha-serve.json sets that model's own batching limits, dtype and device, and
its `version_policy` (Triton's): which numeric versions are served, each its own loaded model.
Default: the highest version only (latest 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.runtime.settings import Settings

DEMO_NAME = "mha"
SETTINGS_FILE = "mha-serve.json"
# What a model's settings file may set (the server's flags of the same names otherwise).
MODEL_SETTINGS = frozenset(
    {"max_batch_size", "max_batch_tokens", "max_batch_delay_ms", "max_queue", "max_seq_len",
     "dtype", "device"}
)  # fmt: skip
LATEST_ONE = {"latest": {"num_versions": 1}}
POLICY_FORMS = '{"latest": {"num_versions": N}}, {"all": {}} or {"specific": {"versions": [1, 3]}}'


class RepositoryError(ValueError):
    """The model sources cannot be served as configured; the message names the path or flag."""


@dataclass(frozen=True)
class ModelSource:
    """One model version to load: its name in URLs, directory (None: the demo model), version,
    its settings file's overrides and the model's version policy (Triton's JSON form)."""

    name: str
    path: Path | None
    version: str = "1"
    overrides: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    policy: dict[str, Any] = field(default_factory=lambda: LATEST_ONE, compare=False, hash=False)


def _read_settings_file(model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """DIR/<model>/mha-serve.json as (settings overrides, version policy); RepositoryError
    naming what is wrong."""
    path = model / SETTINGS_FILE
    if not path.is_file():
        return {}, LATEST_ONE
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise RepositoryError(f"{path} must hold a JSON object")
    policy = values.pop("version_policy", LATEST_ONE)
    unknown = sorted(set(values) - MODEL_SETTINGS)
    if unknown:
        raise RepositoryError(
            f"{path}: unknown setting(s) {unknown}; allowed: {sorted(MODEL_SETTINGS)} "
            "and version_policy"
        )
    return values, policy


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def select_versions(policy: Any, versions: list[int], where: Path) -> list[int]:
    """The versions (ascending) that Triton's `policy` serves out of those on disk;
    RepositoryError naming the policy's problem (`where`: the settings file)."""
    bad = RepositoryError(
        f"{where}: version_policy {json.dumps(policy)} is not valid; use one of {POLICY_FORMS}"
    )
    if not isinstance(policy, dict) or len(policy) != 1:
        raise bad
    ((kind, spec),) = policy.items()
    if not isinstance(spec, dict):
        raise bad
    ordered = sorted(versions)
    if kind == "all" and not spec:
        return ordered
    if kind == "latest" and set(spec) <= {"num_versions"}:
        count = spec.get("num_versions", 1)
        if not _positive_int(count):
            raise RepositoryError(
                f"{where}: version_policy latest.num_versions must be an integer >= 1, "
                f"got {count!r}"
            )
        return ordered[-count:]
    if kind == "specific" and set(spec) == {"versions"}:
        wanted = spec["versions"]
        if not isinstance(wanted, list) or not wanted or not all(map(_positive_int, wanted)):
            raise RepositoryError(
                f"{where}: version_policy specific.versions must be a non-empty list of "
                f"integers >= 1, got {wanted!r}"
            )
        missing = sorted(set(wanted) - set(versions))
        if missing:
            raise RepositoryError(
                f"{where}: version_policy names version(s) {missing} that have no directory "
                f"(on disk: {ordered})"
            )
        return sorted(set(wanted))
    raise bad


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
    """Every served version of every model of a repository, by name then version."""
    if not root.is_dir():
        raise RepositoryError(f"--model-repository {root} is not a directory")
    sources = []
    for model in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        dirs = {int(v.name): v for v in model.iterdir() if v.is_dir() and v.name.isdigit()}
        if not dirs:
            raise RepositoryError(
                f"model '{model.name}' in {root} has no version directory "
                f"(expected {model}/<version>/ with config.json, e.g. {model}/1/)"
            )
        overrides, policy = _read_settings_file(model)
        for version in select_versions(policy, list(dirs), model / SETTINGS_FILE):
            source = ModelSource(model.name, dirs[version], str(version), overrides, policy)
            sources.append(source)  # version "7" may live in 007/, as Triton allows
    return sources


def model_sources(settings: Settings) -> list[ModelSource]:
    """The models to serve, in order (the first is the default for single-model routes)."""
    sources = [ModelSource(Path(path).resolve().name, Path(path)) for path in settings.model_dir]
    if settings.model_repository is not None:
        sources += repository_models(settings.model_repository)
    for source in sources:
        model_settings(settings, source)  # a bad settings file stops the server at start
    if settings.model_name:
        if len({source.name for source in sources}) > 1:
            raise RepositoryError("--model-name names one model; it cannot name several")
        if not sources:
            return [ModelSource(settings.model_name, None)]
        return [replace(source, name=settings.model_name) for source in sources]
    if not sources:
        if settings.model_repository is not None:
            raise RepositoryError(f"--model-repository {settings.model_repository} holds no model")
        return [ModelSource(DEMO_NAME, None)]
    # one place per name: a --model-dir, or one repository model (with all its versions)
    from_dirs = len(settings.model_dir)
    names = [s.name for s in sources[:from_dirs]]
    names += sorted({s.name for s in sources[from_dirs:]})
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RepositoryError(
            f"two models would be served as {', '.join(duplicates)}; model names must be unique"
        )
    return sources
