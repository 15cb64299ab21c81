"""Triton's logging extension over this process's logging: the settings GET /v2/logging and the
gRPC LogSettings show, and the updates they apply (one validator for both protocols).

Triton's names map as: log_info / log_warning / log_error switch those levels on or off (a
filter on the root handlers), log_verbose_level > 0 turns debug records on, log_format is this
server's "text" or "json"; log_file is always "" (logs go to stderr). Two settings of our own:
access_log_sample_rate (--access-log-sample-rate) and access_log_probes (--access-log-probes).
Settings live in the process: with --workers > 1 each front-end has its own, so updates are
refused there (GET still answers).
"""

from __future__ import annotations

import logging
from typing import Any

from service.pipeline.errors import BadInput
from service.runtime.logs import set_access_log_probes, set_log_format
from service.runtime.settings import Settings

log = logging.getLogger("service.logging")

BOOLEANS = ("log_info", "log_warning", "log_error", "access_log_probes")
FORMATS = ("text", "json")
SETTINGS = (*BOOLEANS, "log_verbose_level", "log_format", "log_file", "access_log_sample_rate")


class LevelSwitch(logging.Filter):
    """Drops records of the levels switched off (Triton's log_info / log_warning / log_error)."""

    def __init__(self) -> None:
        super().__init__()
        self.info = self.warning = self.error = True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return self.error
        if record.levelno >= logging.WARNING:
            return self.warning
        if record.levelno >= logging.INFO:
            return self.info
        return True  # debug: the loggers' level lets it through only at log_verbose_level > 0


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_rate(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 <= value <= 1


class LogControl:
    """The log settings of one process (started from its Settings) and their updates."""

    def __init__(self, settings: Settings) -> None:
        level = settings.log_level
        self.updatable = settings.workers == 1
        self.values: dict[str, Any] = {
            "log_file": "",
            "log_info": level in ("debug", "info"),
            "log_warning": level != "error",
            "log_error": True,
            "log_verbose_level": 1 if level == "debug" else 0,
            "log_format": settings.log_format,
            "access_log_sample_rate": settings.access_log_sample_rate,
            "access_log_probes": settings.access_log_probes,
        }
        self.switch = LevelSwitch()

    @property
    def access_log_sample_rate(self) -> float:
        """Read by the access log (service.http.middleware.RequestContext) on every request."""
        return self.values["access_log_sample_rate"]

    def snapshot(self) -> dict[str, Any]:
        return dict(self.values)

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply `changes` (a subset of SETTINGS); BadInput naming every unknown or ill-typed
        setting, and then nothing changes. Returns the settings after the update."""
        if not self.updatable:
            raise BadInput(
                "log settings cannot be changed with --workers > 1 (each front-end process has "
                "its own logging); restart with the flags instead"
            )
        unknown = sorted(set(changes) - set(SETTINGS))
        if unknown:
            raise BadInput(f"unknown log setting(s) {unknown}; this server has {list(SETTINGS)}")
        problems = [p for p in (_problem(k, v) for k, v in changes.items()) if p]
        if problems:
            raise BadInput("; ".join(problems))
        self.values.update(changes)
        self.apply()
        log.info("log settings changed: %s", changes)
        log.debug("log settings now: %s", self.values)
        return self.snapshot()

    def apply(self) -> None:
        """Make the process's logging follow the settings."""
        values = self.values
        switch = self.switch
        switch.info, switch.warning, switch.error = (
            values["log_info"],
            values["log_warning"],
            values["log_error"],
        )
        if values["log_verbose_level"] > 0:
            level = logging.DEBUG
        else:  # the lowest level switched on (the switch drops what is off above it)
            on = [(switch.info, logging.INFO), (switch.warning, logging.WARNING)]
            level = next((lvl for enabled, lvl in on if enabled), logging.ERROR)
        root = logging.getLogger()
        root.setLevel(level)
        for name in ("uvicorn", "uvicorn.error"):
            logging.getLogger(name).setLevel(level)
        for handler in root.handlers:
            if switch not in handler.filters:
                handler.addFilter(switch)
        set_log_format(values["log_format"])
        set_access_log_probes(values["access_log_probes"])


def _problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for setting `name`, or None."""
    if name in BOOLEANS and not _is_bool(value):
        return f"'{name}' must be true or false, got {value!r}"
    if name == "log_verbose_level" and not _is_count(value):
        return f"'log_verbose_level' must be an integer >= 0, got {value!r}"
    if name == "log_format" and value not in FORMATS:
        return f"'log_format' must be one of {list(FORMATS)}, got {value!r}"
    if name == "log_file" and value != "":
        return f"'log_file' must be \"\": this server logs to stderr only, got {value!r}"
    if name == "access_log_sample_rate" and not _is_rate(value):
        return f"'access_log_sample_rate' must be a number in [0, 1], got {value!r}"
    return None
