"""Triton's load `config` parameter (tritonclient's `load_model(name, config=...)`, HTTP and gRPC)
as a model's own settings, applied over its mha-serve.json for that load.

The config is a JSON object holding mha-serve.json's keys (max_batch_size, max_batch_tokens,
max_batch_delay_ms, batch_delay_policy, max_queue, max_seq_len, dtype, device, optional_inputs,
response_cache, version_policy)
and/or Triton's model-configuration names where they map: max_batch_size and version_policy
(the same), dynamic_batching.max_queue_delay_microseconds (max_batch_delay_ms),
dynamic_batching.default_queue_policy.max_queue_size (max_queue) and response_cache.enable
(response_cache); `name`, `platform` and `backend` may be given if they match. Anything else
is refused naming it, and the values are validated as the settings file's are
(service.runtime.repository).
"""

from __future__ import annotations

import json
from typing import Any

from service.oip.model_config import PLATFORM
from service.pipeline.errors import BadInput
from service.runtime.repository import (
    MODEL_SETTINGS,
    ModelSettings,
    RepositoryError,
    parse_model_settings,
)

# Triton's names this server maps: dynamic_batching.<key> -> the settings key.
BATCHING = {"max_queue_delay_microseconds": "max_batch_delay_ms"}
QUEUE_POLICY = {"max_queue_size": "max_queue"}
IDENTITY = ("name", "platform", "backend")  # accepted when they match what is served
ALLOWED = sorted({*MODEL_SETTINGS, "version_policy", "dynamic_batching", *IDENTITY})


def _integer(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadInput(f"load config: '{field}' must be an integer >= 0, got {value!r}")
    return value


def _object(value: Any, field: str, allowed: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadInput(f"load config: '{field}' must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        names = [f"{field}.{key}" for key in unknown]
        raise BadInput(f"load config: unsupported field(s) {names}; {field} may set {allowed}")
    return value


def _batching(value: Any, values: dict[str, Any]) -> None:
    """dynamic_batching's mapped fields into `values` (settings-file keys)."""
    batching = _object(value, "dynamic_batching", [*BATCHING, "default_queue_policy"])
    mapped: dict[str, Any] = {}
    if "max_queue_delay_microseconds" in batching:
        micros = _integer(
            batching["max_queue_delay_microseconds"],
            "dynamic_batching.max_queue_delay_microseconds",
        )
        mapped["max_batch_delay_ms"] = micros / 1000
    if "default_queue_policy" in batching:
        field = "dynamic_batching.default_queue_policy"
        policy = _object(batching["default_queue_policy"], field, list(QUEUE_POLICY))
        if "max_queue_size" in policy:
            mapped["max_queue"] = _integer(policy["max_queue_size"], f"{field}.max_queue_size")
    twice = sorted(set(mapped) & set(values))
    if twice:
        raise BadInput(f"load config sets {twice} twice (directly and through dynamic_batching)")
    values.update(mapped)


def parse_load_config(text: Any, model: str) -> ModelSettings:
    """The `config` parameter of a load of `model` as its settings; BadInput naming the field."""
    if not isinstance(text, str):
        raise BadInput(f"the 'config' parameter must be a JSON string, got {type(text).__name__}")
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"the 'config' parameter is not valid JSON: {exc}") from None
    config = _object(config, "config", ALLOWED)
    values = {k: v for k, v in config.items() if k not in (*IDENTITY, "dynamic_batching")}
    for field, served in (("name", model), ("platform", PLATFORM), ("backend", PLATFORM)):
        if field in config and config[field] != served:
            raise BadInput(f"load config: '{field}' is {config[field]!r}; it must be {served!r}")
    if "dynamic_batching" in config:
        _batching(config["dynamic_batching"], values)
    if isinstance(config.get("response_cache"), dict):  # Triton's form: {"enable": bool}
        cache = _object(config["response_cache"], "response_cache", ["enable"])
        if not isinstance(cache.get("enable", False), bool):  # absent: false, as in Triton
            raise BadInput("load config: 'response_cache.enable' must be true or false")
        values["response_cache"] = cache.get("enable", False)
    try:
        return parse_model_settings(values, f"model '{model}' load config")
    except RepositoryError as exc:
        raise BadInput(str(exc)) from None
