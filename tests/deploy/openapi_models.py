"""Strict offline validation of custom resources against an OpenAPI-generated Python SDK.

KServe's Python SDK (the `kserve` package, pinned in the test extra) carries one model class per
type of its API, generated from the OpenAPI spec of the Go types its CRDs are generated from;
Kubernetes' own types come from the `kubernetes` client the same way. Each class lists its
fields (`openapi_types`: Python name -> type, `attribute_map`: Python name -> JSON key) and
which are required. This walks a manifest down those types: an unknown
key, a wrong JSON type or a missing required field is an error, with its path.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import subprocess
import sys
from typing import Any

PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "datetime": (str,),
    "date": (str,),
}


def model_class(name: str) -> type:
    import kserve.models
    import kubernetes.client.models

    for module in (kserve.models, kubernetes.client.models):
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise LookupError(f"no model class {name} in kserve or kubernetes")


def errors(value: Any, type_name: str, path: str = "") -> list[str]:
    """Every way `value` (parsed YAML/JSON) does not fit `type_name`; [] when it fits."""
    if type_name == "object":  # free-form (IntOrString, RawExtension, status)
        return []
    # kserve writes list[X] / dict(str, X); the kubernetes client, List[X] / Dict[str, X].
    if m := re.fullmatch(r"[lL]ist\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in errors(item, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected a map, got {type(value).__name__}"]
        inner = m[1] or m[2]
        return [e for k, item in value.items() for e in errors(item, inner, f"{path}.{k}")]
    if type_name in PRIMITIVES:
        ok = isinstance(value, PRIMITIVES[type_name]) and not (
            type_name != "bool" and isinstance(value, bool)
        )
        return [] if ok else [f"{path}: expected {type_name}, got {value!r}"]
    cls = model_class(type_name)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} object, got {type(value).__name__}"]
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    found = [f"{path}.{key}: unknown field of {type_name}" for key in value if key not in by_key]
    for key, item in value.items():
        if key in by_key:
            found += errors(item, cls.openapi_types[by_key[key]], f"{path}.{key}")
    missing = required(cls) - value.keys()
    return found + [f"{path}.{key}: required by {type_name}" for key in sorted(missing)]


@functools.cache
def required(cls: type) -> frozenset[str]:
    """JSON keys of `cls` the OpenAPI spec requires: pydantic fields without a default (the
    kubernetes client's models), or those whose generated setter refuses None (kserve's)."""
    fields = getattr(cls, "model_fields", None)
    if fields is not None:
        return frozenset(cls.attribute_map[a] for a, f in fields.items() if f.is_required())
    keys = set()
    for attr, key in cls.attribute_map.items():
        setter = getattr(cls, attr).fset
        if "must not be `None`" in inspect.getsource(setter):
            keys.add(key)
    return frozenset(keys)


def errors_of(items: list[tuple[dict, str]]) -> list[list[str]]:
    """`errors(doc, type_name)` for each item, computed in a fresh interpreter (see above)."""
    from tests.support import ROOT

    result = subprocess.run(
        [sys.executable, "-m", "tests.deploy.openapi_models"],
        input=json.dumps(items),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


if __name__ == "__main__":
    json.dump([errors(doc, type_name) for doc, type_name in json.load(sys.stdin)], sys.stdout)
