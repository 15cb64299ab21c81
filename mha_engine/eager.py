"""`eager_only`: what torch.compiler.disable does, without importing torch._dynamo at import time.

torch.compiler.disable imports torch._dynamo as it decorates: about 1.7 s of every process's
start (the service and its workers, the CLI, a failing start's one-line error) for a guard that
matters only once something runs torch.compile. Until torch._dynamo is imported nothing can be
tracing, so the function is called as it is; after that, through torch's own lazy
`torch._disable_dynamo` wrapper (dynamo runs it eagerly, never tracing into it)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """fn, never traced by torch.compile / torch.export (a graph break around it)."""
    disabled = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]
