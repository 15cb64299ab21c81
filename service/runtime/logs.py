"""Logging set-up: plain text, or JSON lines carrying the request id and access-log fields."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import orjson


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any structured extras."""

    FIELDS = ("request_id", "status", "duration_ms", "method", "path", "trace_id")

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


PROBE_PATHS = ("/v2/health/", "/metrics", "/health", "/ping")
PROBE_METHODS = ("ServerLive", "ServerReady")  # gRPC's health probes (their lines' path)


def _not_probe(record: logging.LogRecord) -> bool:
    """Drops access-log lines of health probes and metrics scrapes (--no-access-log-probes),
    over HTTP and gRPC."""
    path = str(getattr(record, "path", ""))
    if getattr(record, "method", None) == "GRPC":
        return path not in PROBE_METHODS
    return not path.startswith(PROBE_PATHS)


def set_access_log_probes(on: bool) -> None:
    """Keep (True) or drop (False) the access-log lines of probes and scrapes."""
    access = logging.getLogger("service.access")
    for old in [f for f in access.filters if f is _not_probe]:
        access.removeFilter(old)
    if not on:
        access.addFilter(_not_probe)


class TextFormatter(logging.Formatter):
    """logging.Formatter with its default time format, the date and time part made once per
    second rather than per line (strftime on every access-log line adds up)."""

    _second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached = self._second
        if cached[0] != second:  # (a race only formats the same second twice)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            cached = self._second = (second, text)
        return self.default_msec_format % (cached[1], record.msecs)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of log format `fmt`: "text" or "json"."""
    if fmt == "json":
        return JsonFormatter()
    return TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def set_log_format(fmt: str) -> None:
    """Switch the root handlers configure_logging installed to format `fmt`."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "mha_serve", False):
            handler.setFormatter(formatter(fmt))


def configure_logging(level: str, fmt: str, access_log_probes: bool = True) -> None:
    """Root logging for the server process: `fmt` is "text" or "json"."""
    set_access_log_probes(access_log_probes)
    handler = logging.StreamHandler()
    handler.mha_serve = True  # type: ignore[attr-defined]  # ours: set_log_format may switch it
    handler.setFormatter(formatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
