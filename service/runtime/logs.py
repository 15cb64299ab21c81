"""Logging set-up: plain text, or JSON lines carrying the request id and access-log fields."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any structured extras."""

    FIELDS = ("request_id", "status", "duration_ms", "method", "path")

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def rfc3339(created: float) -> str:
    """A log record's time as RFC 3339 UTC with milliseconds: 2026-11-23T07:31:02.123Z."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


PROBE_PATHS = ("/v2/health/", "/metrics")


def _not_probe(record: logging.LogRecord) -> bool:
    """Drops access-log lines of health probes and metrics scrapes (--no-access-log-probes)."""
    return not str(getattr(record, "path", "")).startswith(PROBE_PATHS)


def configure_logging(level: str, fmt: str, access_log_probes: bool = True) -> None:
    """Root logging for the server process: `fmt` is "text" or "json"."""
    access = logging.getLogger("service.access")
    for old in [f for f in access.filters if f is _not_probe]:
        access.removeFilter(old)
    if not access_log_probes:
        access.addFilter(_not_probe)
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
