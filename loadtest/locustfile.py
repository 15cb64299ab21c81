"""Locust users for mha-serve: OIP inference over binary and JSON, mixed lengths, B>1 requests.

Run from the repository root, e.g. headless through `python -m loadtest.run`, or
`locust -f loadtest/locustfile.py --host http://127.0.0.1:8000` for the web UI. Pick users by
class name (BinaryUser JsonUser MixedLengthUser MultiSequenceUser); all four by default.
Every option below is also an env var (MHA_LT_*). The embedding width E is read from
GET /v2/models/{name} when the test starts, so it need not be given.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

import gevent
import numpy as np
from locust import FastHttpUser, events, task
from locust.exception import StopUser
from locust.runners import WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

# Locust imports this file by path; make `loadtest.payloads` importable from any cwd.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadtest.payloads import (
    BINARY_HEADER,
    Body,
    BodyFactory,
    LengthDistribution,
    check_response,
)

log = logging.getLogger("mha-loadtest")
DEFAULT_HOST = "http://127.0.0.1:8000"
ATTENTION_NAME = "attention (debug)"
# Filled at test start: {"embed_dim": E}; empty when the model could not be read.
MODEL: dict[str, int] = {}
_USER_IDS = itertools.count()
_ENVIRONMENT: list[Any] = []  # set by the init event; the quit event has no environment


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def _lengths(text: str) -> str:
    try:
        LengthDistribution(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    """mha-serve options; each has an MHA_LT_* env var (e.g. --seq-len <- MHA_LT_SEQ_LEN)."""
    options: list[tuple[str, dict[str, Any]]] = [
        ("--model-name", dict(default="mha", help="Model name in /v2/models/{name}/infer.")),
        (
            "--embed-dim",
            dict(type=int, default=0, help="Input width E; 0 reads it from model metadata."),
        ),
        (
            "--seq-len",
            dict(type=_positive, default=16, help="T for BinaryUser, JsonUser, MultiSequenceUser."),
        ),
        (
            "--lengths",
            dict(
                type=_lengths,
                default="uniform:16:256",
                help="T distribution of MixedLengthUser: '64', 'uniform:16:256', "
                "'loguniform:16:256' or 'choice:16,64,256'.",
            ),
        ),
        ("--batch", dict(type=_positive, default=4, help="B of MultiSequenceUser requests.")),
        (
            "--payload",
            dict(
                choices=["binary", "json"],
                default="binary",
                help="Body format of MixedLengthUser and MultiSequenceUser.",
            ),
        ),
        (
            "--check-fraction",
            dict(
                type=_fraction,
                default=0.05,
                help="Share of responses checked (shape, finite values); wrong ones fail.",
            ),
        ),
        (
            "--think-time",
            dict(type=float, default=0.0, help="Seconds each user waits between requests."),
        ),
        (
            "--attention-fraction",
            dict(
                type=_fraction,
                default=0.0,
                help="Share of requests sent to the debug endpoint POST "
                "/v2/models/{name}/attention instead of /infer (0 = off).",
            ),
        ),
        (
            "--attention-token",
            dict(
                default="",
                is_secret=True,
                help="Bearer token for the debug endpoint, if the server requires one.",
            ),
        ),
        ("--seed", dict(type=int, default=0, help="Seed of the users' random inputs.")),
    ]
    for flag, kwargs in options:
        env_var = "MHA_LT_" + flag.removeprefix("--").replace("-", "_").upper()
        kwargs["help"] = f"{kwargs['help']} [env {env_var}]"
        parser.add_argument(flag, env_var=env_var, **kwargs)


def read_embed_dim(host: str, model_name: str) -> int:
    """E of the served model: inputs[0].shape[-1] of GET /v2/models/{name}."""
    url = f"{host.rstrip('/')}/v2/models/{quote(model_name)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        metadata = json.load(response)
    embed_dim = int(metadata["inputs"][0]["shape"][-1])
    if embed_dim < 1:
        raise ValueError(f"model metadata at {url} has no fixed input width")
    return embed_dim


@events.test_start.add_listener
def read_model(environment: Any, **_: Any) -> None:
    """Fetch E once per test (not per user); stop the run with exit code 2 if it fails."""
    opts = environment.parsed_options
    MODEL.clear()
    if environment.process_exit_code == 2:
        environment.process_exit_code = None  # web UI: a new start after a failed one
    host = environment.host or DEFAULT_HOST
    try:
        MODEL["embed_dim"] = opts.embed_dim or read_embed_dim(host, opts.model_name)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        detail = (
            exc.read().decode(errors="replace") if isinstance(exc, urllib.error.HTTPError) else exc
        )
        log.error(
            "cannot read model %r from %s: %s -- check --host and --model-name, "
            "or pass --embed-dim",
            opts.model_name,
            host,
            detail,
        )
        environment.process_exit_code = 2
        if environment.runner is not None:  # headless: exit; web UI: stop, fix, start again
            headless = getattr(opts, "headless", False)
            gevent.spawn_later(
                0.1, environment.runner.quit if headless else environment.runner.stop
            )
        return
    trickle = f"{opts.attention_fraction:.1%} of requests" if opts.attention_fraction else "off"
    log.info(
        "model %r at %s: E=%d; T=%d, B=%d (MultiSequenceUser), lengths %s (MixedLengthUser), "
        "payload %s, checking %.1f%% of responses, attention trickle %s",
        opts.model_name, host, MODEL["embed_dim"], opts.seq_len, opts.batch, opts.lengths,
        opts.payload, 100 * opts.check_fraction, trickle,
    )  # fmt: skip


@events.init.add_listener
def remember_environment(environment: Any, **_: Any) -> None:
    _ENVIRONMENT[:] = [environment]


@events.quit.add_listener
def write_final_csv(**_: Any) -> None:
    """Rewrite --csv totals after the last request: Locust's CSV writer runs once a second and
    does not write again at exit, so its files would miss the final moments of the run."""
    if not _ENVIRONMENT:
        return
    environment = _ENVIRONMENT[0]
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if not prefix or isinstance(environment.runner, WorkerRunner):
        return
    writer = StatsCSV(environment, PERCENTILES_TO_REPORT)
    with open(f"{prefix}_stats.csv", "w", newline="") as f:
        writer.requests_csv(csv.writer(f))
    with open(f"{prefix}_failures.csv", "w", newline="") as f:
        writer.failures_csv(csv.writer(f))


def _error_text(response: Any) -> str:
    """The server's {"error": ...} message, or the start of the body."""
    try:
        return str(json.loads(response.content)["error"])[:160]
    except (ValueError, KeyError, TypeError):
        return (response.text or "")[:160]


class OipUser(FastHttpUser):
    """One closed-loop client: sends a request, waits for the answer, thinks, repeats."""

    abstract = True
    host = DEFAULT_HOST
    network_timeout = 60.0
    connection_timeout = 10.0
    binary: bool | None = None  # None: the --payload option decides

    def wait_time(self) -> float:
        return self.opts.think_time

    def on_start(self) -> None:
        self.ready = "embed_dim" in MODEL
        if not self.ready:
            return  # test_start logged why and stops the run; the task ends this user
        self.opts = self.environment.parsed_options
        self.rng = np.random.default_rng([self.opts.seed, next(_USER_IDS)])
        if self.binary is None:
            self.binary = self.opts.payload == "binary"
        model = quote(self.opts.model_name)
        self.infer_path = f"/v2/models/{model}/infer"
        self.attention_path = f"/v2/models/{model}/attention"
        self.auth = (
            {"Authorization": f"Bearer {self.opts.attention_token}"}
            if self.opts.attention_token
            else {}
        )
        self.factory = BodyFactory(MODEL["embed_dim"], self.max_tokens(), self.binary, self.rng)
        self.prepare()

    # -- what each user class sends -----------------------------------------------------------
    def max_tokens(self) -> int:
        return self.opts.seq_len

    def prepare(self) -> None:
        """Build the fixed body once; mixed-length users override next_body instead."""
        self.fixed = self.factory.body(1, self.opts.seq_len)

    def next_body(self) -> Body:
        return self.fixed

    @property
    def label(self) -> str:
        body = self.fixed
        return f"{'binary' if self.binary else 'json'} B={body.shape[0]} T={body.shape[1]}"

    # -- the task -----------------------------------------------------------------------------
    @task
    def infer(self) -> None:
        if not self.ready:
            raise StopUser()  # quietly, unlike an exception in on_start
        fraction = self.opts.attention_fraction
        if fraction and self.rng.random() < fraction:
            self.post(self.attention_path, self.next_body(), ATTENTION_NAME, False, self.auth)
            return
        check = self.rng.random() < self.opts.check_fraction
        self.post(self.infer_path, self.next_body(), self.label, check)

    def post(
        self, path: str, body: Body, name: str, check: bool, extra: dict[str, str] | None = None
    ) -> None:
        """POST `body`; wrong answers, 429s (under their own name) and errors count as failures."""
        headers = {**body.headers, **extra} if extra else body.headers
        no_response = False
        with self.client.post(
            path, data=body.data, headers=headers, name=name, catch_response=True
        ) as response:
            status = response.status_code
            if status == 200:
                problem = (
                    check_response(
                        response.content, response.headers.get(BINARY_HEADER), body.shape
                    )
                    if check
                    else None
                )
                if problem:
                    response.failure(f"wrong output: {problem}")
                else:
                    response.success()
            elif status == 429:
                # Its own row: overload is visible, and fast rejections don't flatter latency.
                response.request_meta["name"] = f"{name} [429 overloaded]"
                response.failure(
                    "429 overloaded: debug requests at --debug-max-concurrency"
                    if path == self.attention_path
                    else "429 overloaded: server queue full (--max-queue)"
                )
            elif status == 0:
                response.failure(f"no response: {response.error!r:.160}")
                no_response = True
            elif path == self.attention_path and status == 404:
                response.failure("404: debug attention endpoint is off on this server")
            elif path == self.attention_path and status in (401, 403):
                response.failure(f"HTTP {status}: missing or wrong --attention-token")
            else:
                response.failure(f"HTTP {status}: {_error_text(response)}")
        if no_response:  # server down or unreachable: don't spin at thousands of failures a second
            gevent.sleep(1.0)


class BinaryUser(OipUser):
    """[1, T, E] FP32 over Triton's binary tensor extension; body built once per user."""

    binary = True


class JsonUser(OipUser):
    """[1, T, E] FP32 as OIP JSON 'data'; body built once per user."""

    binary = False


class MultiSequenceUser(OipUser):
    """[B, T, E] requests (B = --batch): several sequences in one request."""

    def max_tokens(self) -> int:
        return self.opts.batch * self.opts.seq_len

    def prepare(self) -> None:
        self.fixed = self.factory.body(self.opts.batch, self.opts.seq_len)


class MixedLengthUser(OipUser):
    """[1, T, E] with T drawn per request from --lengths (e.g. uniform:16:256)."""

    def max_tokens(self) -> int:
        return self.lengths.max

    def on_start(self) -> None:
        self.lengths = LengthDistribution(self.environment.parsed_options.lengths)
        super().on_start()

    def prepare(self) -> None:
        pass

    def next_body(self) -> Body:
        return self.factory.body(1, self.lengths.sample(self.rng))

    @property
    def label(self) -> str:
        return f"{'binary' if self.binary else 'json'} B=1 T~{self.lengths.spec}"
