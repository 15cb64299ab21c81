"""Which models the server loads: --model-dir (repeatable) and a Triton-style --model-repository.

A repository holds DIR/<model>/<version>/, each version directory a model directory as
--model-dir takes it (config.json + weights, or a Hugging Face BERT-family directory). An
optional DIR/<model>/mha-serve.json sets that model's own batching limits, dtype and device,
whether it declares its optional inputs (optional_inputs), and its `version_policy` (Triton's):
which numeric versions are served, each its own loaded model.
Default: the highest version only (latest 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.runtime.settings import Settings

DEMO_NAME = "mha"
SETTINGS_FILE = "mha-serve.json"
# What a model's settings file may set (the server's flags of the same names otherwise).
MODEL_SETTINGS = frozenset(
    {"max_batch_size", "max_batch_tokens", "max_batch_delay_ms", "batch_delay_policy",
     "max_queue", "max_seq_len", "dtype", "device", "optional_inputs", "response_cache",
     "pooling", "default_prompt_name", "default_prompt", "dense_path"}
)  # fmt: skip
PROMPT_PAIR = ("default_prompt", "default_prompt_name")  # exclusive: one setting in two forms
LATEST_ONE = {"latest": {"num_versions": 1}}
POLICY_FORMS = '{"latest": {"num_versions": N}}, {"all": {}} or {"specific": {"versions": [1, 3]}}'


class RepositoryError(ValueError):
    """The model sources cannot be served as configured; the message names the path or flag."""


@dataclass(frozen=True)
class ModelSource:
    """One model version to load: its name in URLs, directory (None: the demo model), version,
    its settings file's overrides (with a load's config over them), the model's version policy
    (Triton's JSON form) and where the overrides came from (for error messages)."""

    name: str
    path: Path | None
    version: str = "1"
    overrides: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    policy: dict[str, Any] = field(default_factory=lambda: LATEST_ONE, compare=False, hash=False)
    origin: str = field(default=SETTINGS_FILE, compare=False, hash=False)


@dataclass(frozen=True)
class ModelSettings:
    """A model's own settings, as a settings file or a load's `config` gives them: overrides
    of the server's flags (MODEL_SETTINGS) and a version policy (None: not given)."""

    overrides: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] | None = None

    def over(self, base: ModelSettings) -> ModelSettings:
        """These settings applied on top of `base` (a load's config over the settings file)."""
        policy = self.policy if self.policy is not None else base.policy
        return ModelSettings({**base.overrides, **self.overrides}, policy)


def parse_model_settings(values: Any, where: str) -> ModelSettings:
    """A settings file's JSON value (or a load config in that form) as ModelSettings;
    RepositoryError naming `where` and any unknown setting. Values are checked when applied
    (model_settings, select_versions), the same for both."""
    if not isinstance(values, dict):
        raise RepositoryError(f"{where} must hold a JSON object")
    values = dict(values)
    policy = values.pop("version_policy", None)
    unknown = sorted(set(values) - MODEL_SETTINGS)
    if unknown:
        raise RepositoryError(
            f"{where}: unknown setting(s) {unknown}; allowed: {sorted(MODEL_SETTINGS)} "
            "and version_policy"
        )
    return ModelSettings(values, policy)


def _read_settings_file(model: Path) -> ModelSettings:
    """DIR/<model>/mha-serve.json (empty settings if absent); RepositoryError naming what is
    wrong."""
    path = model / SETTINGS_FILE
    if not path.is_file():
        return ModelSettings()
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{path} is not valid JSON: {exc}") from None
    return parse_model_settings(values, str(path))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def select_versions(policy: Any, versions: list[int], where: Path | str) -> list[int]:
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
    values = settings.model_dump()
    for one, other in PROMPT_PAIR, PROMPT_PAIR[::-1]:  # a model's own one replaces the server's
        if one in source.overrides and other not in source.overrides:
            values[other] = None
    try:
        return type(settings)(**{**values, **source.overrides})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise RepositoryError(f"model '{source.name}' {source.origin}: {problems}") from None


def _versions(
    name: str, dirs: dict[int, Path], own: ModelSettings, config: ModelSettings | None, where: str
) -> list[ModelSource]:
    """The versions of model `name` (version -> directory) its policy serves, with its own
    settings and a load's `config` over them."""
    origin = SETTINGS_FILE
    if config is not None:
        own, origin = config.over(own), "load config"
        where = f"model '{name}' load config"
    policy = own.policy if own.policy is not None else LATEST_ONE
    return [
        ModelSource(name, dirs[version], str(version), own.overrides, policy, origin)
        for version in select_versions(policy, list(dirs), where)
    ]  # version "7" may live in 007/, as Triton allows


def repository_models(
    root: Path, config_for: Callable[[str], ModelSettings | None] = lambda name: None
) -> list[ModelSource]:
    """Every served version of every model of a repository, by name then version
    (`config_for(name)`: a load's config for the model, over its settings file)."""
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
        own = _read_settings_file(model)
        config = config_for(model.name)
        sources += _versions(model.name, dirs, own, config, str(model / SETTINGS_FILE))
    return sources


def model_sources(
    settings: Settings, configs: Mapping[str, ModelSettings] | None = None
) -> list[ModelSource]:
    """The models to serve, in order (the first is the default for single-model routes).
    `configs` (model name -> settings): a load's `config`, over the model's settings file,
    validated the same way."""
    configs = configs or {}

    def config_for(name: str) -> ModelSettings | None:  # by the name it is served under
        return configs.get(settings.model_name or name)

    sources = []
    for path in map(Path, settings.model_dir):
        name = path.resolve().name
        config = config_for(name)
        if config is None:
            sources.append(ModelSource(name, path))
        else:  # one version, "1": a policy may only pick it
            sources += _versions(name, {1: path}, ModelSettings(), config, "")
    if settings.model_repository is not None:
        sources += repository_models(settings.model_repository, config_for)
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
