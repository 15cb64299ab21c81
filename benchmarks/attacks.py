"""Hostile-client attacks on the request path, with figures, against a real server on loopback.

`python -m benchmarks.attacks all` runs each attack on a fresh server and prints JSON: the
statuses the attacker got, the server's CPU seconds and RSS, what the next request on the same
connection got, log lines, exit time. `--root DIR` runs the server from another checkout (e.g.
`git archive 75093a7 | tar -x -C /tmp/old`), so the same attacks measure the code before a fix.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import reliability, scrape
from benchmarks.server import HOST, ROOT, Proc, running

INFER = "/v2/models/mha/infer"
HUGE = [4294967296, 4294967296]  # 2**64 elements: 0 in int64


def _exchange(sock: socket.socket, method: str, path: str, body: bytes, headers: dict) -> int:
    """One HTTP/1.1 request on an open socket; its status, or -1 if the server closed it."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    try:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return -1
            data += chunk
        raw, rest = data.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        while len(rest) < int(fields.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                return -1
            rest += chunk
        return int(lines[0].split()[1])
    except OSError:
        return -1


def _rss_mb(server: Proc, key: str = "VmRSS") -> float:
    return round(server.status(key) / 1024, 1)


def embeddings(root: Path, model_dir: Path, chars: int) -> dict[str, Any]:
    """One request whose single input is a `chars`-character word (no spaces)."""
    args = ("--log-level", "warning", "--model-dir", str(model_dir), "--model-name", "m")
    with running(*args, root=root) as server:
        cpu, rss = server.cpu_seconds(), _rss_mb(server)
        body = json.dumps({"model": "m", "input": ["x" * chars]}).encode()
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/embeddings", content=body, timeout=120)
        took = time.monotonic() - started
        return {
            "chars": chars,
            "status": response.status_code,
            "answer_s": round(took, 2),
            "server_cpu_s": round(server.cpu_seconds() - cpu, 2),
            "rss_before_mb": rss,
            "rss_peak_mb": _rss_mb(server, "VmHWM"),
            "rss_after_mb": _rss_mb(server),
        }


def _shape_attacks() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    def binary(*inputs: tuple[str, list[int], str, int]) -> tuple[bytes, dict[str, str]]:
        head = json.dumps({"inputs": [
            {"name": n, "shape": s, "datatype": d, "parameters": {"binary_data_size": b}}
            for n, s, d, b in inputs
        ]}).encode()  # fmt: skip
        total = sum(b for *_, b in inputs)
        return head + bytes(total), {"Inference-Header-Content-Length": str(len(head))}

    ok = {"name": "input", "shape": [1, 2, 512], "datatype": "FP32", "data": [0.5] * 1024}
    json_input = {"inputs": [{"name": "input", "shape": [1, *HUGE], "datatype": "FP32",
                              "data": []}]}  # fmt: skip
    json_mask = {"inputs": [ok, {"name": "key_padding_mask", "shape": HUGE, "datatype": "BOOL",
                                 "data": []}]}  # fmt: skip
    attacks = {}
    for route in ("infer", "attention"):
        path = f"/v2/models/mha/{route}"
        attacks[f"{route} json input"] = (path, json.dumps(json_input).encode(), {})
        attacks[f"{route} json mask"] = (path, json.dumps(json_mask).encode(), {})
        attacks[f"{route} binary input"] = (path, *binary(("input", [1, *HUGE], "FP32", 0)))
        attacks[f"{route} binary mask"] = (
            path,
            *binary(("input", [1, 2, 512], "FP32", 4096), ("key_padding_mask", HUGE, "BOOL", 0)),
        )
    return attacks


def shapes(root: Path) -> dict[str, Any]:
    """Each overflowing shape, then a valid request on the same keep-alive connection."""
    good, good_headers = reliability.binary_body(1, 4)
    out: dict[str, Any] = {}
    with running("--log-level", "warning", "--debug-endpoint", root=root) as server:
        for name, (path, body, headers) in _shape_attacks().items():
            with socket.create_connection((HOST, server.port), timeout=30) as sock:
                status = _exchange(sock, "POST", path, body, headers)
                after = _exchange(sock, "POST", INFER, good, good_headers)
            out[name] = {"status": status, "next_on_same_connection": after}
    return out


def disconnects(root: Path, count: int = 20) -> dict[str, Any]:
    """`count` clients that send headers and 1 kB of a 1 MB body, then close the socket."""
    with running("--log-level", "info", root=root, log_path=_log_path()) as server:
        head = (
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
            "Inference-Header-Content-Length: 100\r\n\r\n"
        ).encode()
        for _ in range(count):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.sendall(head + bytes(1000))
                time.sleep(0.05)
        time.sleep(1.0)
        metrics = scrape.scrape(server.url)
        log = server.log()
    statuses = scrape.by_label(metrics, "mha_requests_total", "status", endpoint="infer")
    reasons = {
        reason: n
        for reason, n in scrape.by_label(metrics, "mha_request_failures_total", "reason").items()
        if n > 0
    }
    return {
        "clients": count,
        "statuses": statuses,
        "failure_reasons": reasons,
        "error_log_lines": log.count(" ERROR "),
        "tracebacks": log.count("Traceback"),
    }


def drain(root: Path, requests: int = 64, grace_s: float = 5.0) -> dict[str, Any]:
    """`requests` long requests in flight (one sequence per forward), SIGTERM, grace `grace_s`."""
    args = ("--log-level", "warning", "--max-batch-size", "1", "--drain-grace-s", str(grace_s))
    with running(*args, "--request-timeout-s", "120", root=root) as server:
        result = reliability.drain(server, requests=requests, seq_len=1024)
    return {"grace_s": grace_s, **result}


def auth(root: Path) -> dict[str, Any]:
    """--api-key K --debug-endpoint (no --debug-token): what each credential gets."""
    body, headers = reliability.binary_body(1, 4)
    attention_body = json.dumps({"inputs": [{"name": "input", "shape": [1, 2, 512],
                                 "datatype": "FP32", "data": [0.5] * 1024}]}).encode()  # fmt: skip
    out = {}
    key = {"MHA_API_KEY": "K"}
    credentials = (("no credentials", {}), ("'bearer K'", {"Authorization": "bearer K"}))
    with running("--log-level", "warning", "--debug-endpoint", root=root, env=key) as s:
        for label, auth_header in credentials:
            out[label] = {
                "attention": httpx.post(f"{s.url}/v2/models/mha/attention",
                                        content=attention_body, headers=auth_header).status_code,
                "heads": httpx.get(f"{s.url}/v2/models/mha/heads", headers=auth_header).status_code,
                "infer": httpx.post(f"{s.url}{INFER}", content=body,
                                    headers={**headers, **auth_header}).status_code,
            }  # fmt: skip
    return out


def decoding(root: Path, json_mb: int = 16) -> dict[str, Any]:
    """Strict decoding, HEAD, log forging, and health latency while a big JSON body announced
    with Inference-Header-Content-Length is decoded."""
    out: dict[str, Any] = {}
    with running("--log-level", "info", root=root, log_path=_log_path()) as server:
        url = f"{server.url}{INFER}"

        def fp32(data: list, **extra: Any) -> bytes:
            tensor = {"name": "input", "shape": [1, 2, 512], "datatype": "FP32", "data": data}
            return json.dumps({"inputs": [tensor], **extra}).encode()

        out["'0.1' strings as FP32"] = httpx.post(url, content=fp32(["0.1"] * 1024)).status_code
        out["booleans as FP32"] = httpx.post(url, content=fp32([True] * 1024)).status_code
        flag = {"outputs": [{"name": "output", "parameters": {"binary_data": "false"}}]}
        response = httpx.post(url, content=fp32([0.5] * 1024, **flag))
        out['binary_data: "false"'] = f"{response.status_code} {response.headers['content-type']}"
        body, headers = reliability.binary_body(1, 4)
        length = headers["Inference-Header-Content-Length"]
        plus = {**headers, "Inference-Header-Content-Length": f"+{length}"}
        out["header length '+N'"] = httpx.post(url, content=body, headers=plus).status_code
        out["HEAD /v2/health/ready"] = httpx.head(f"{server.url}/v2/health/ready").status_code
        out["HEAD /metrics"] = httpx.head(f"{server.url}/metrics").status_code
        forged = "/v2/health/live%0A1999-01-01 00:00:00,000 INFO service.access: GET /forged 200"
        httpx.get(server.url + forged)
        out["%0A forged log lines"] = sum(
            line.startswith("1999-01-01") for line in server.log().splitlines()
        )
        out.update(_health_under_json_header(server, json_mb))
    return out


def _health_under_json_header(server: Proc, json_mb: int) -> dict[str, Any]:
    batch = max(1, json_mb * 2**20 // 10 // (1024 * 512))  # ~10 bytes per JSON value
    values = np.random.default_rng(0).standard_normal(batch * 1024 * 512).round(6)
    tensor = {"name": "input", "shape": [batch, 1024, 512], "datatype": "FP32",
              "data": values.tolist()}  # fmt: skip
    body = json.dumps({"inputs": [tensor]}).encode()
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                client.get(f"{server.url}/v2/health/live")
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.3)
    status = httpx.post(
        f"{server.url}{INFER}",
        content=body,
        headers={"Inference-Header-Content-Length": str(len(body))},
        timeout=120,
    ).status_code
    time.sleep(0.3)
    stop.set()
    thread.join()
    return {
        "json+header body": f"{len(body) / 2**20:.0f} MB, status {status}",
        "health p50 / max during it (ms)": (
            round(1000 * float(np.median(latencies)), 1),
            round(1000 * max(latencies), 1),
        ),
    }


def decode_cost(root: Path, repeats: int = 5) -> dict[str, Any]:
    """Not an attack: what strict decoding costs. Best time of `decode_request` (from `root`'s
    service/oip/codecs.py) on a 1M-value FP32 JSON body with `is_causal: true`, in this process."""
    spec = importlib.util.spec_from_file_location(
        "codecs_under_test", root / "service/oip/codecs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    values = np.random.default_rng(0).standard_normal((4, 512, 512)).astype(np.float32)
    tensor = {"name": "input", "shape": [4, 512, 512], "datatype": "FP32",
              "data": values.tolist()}  # fmt: skip
    body = json.dumps({"inputs": [tensor], "parameters": {"is_causal": True}}).encode()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        module.decode_request(bytearray(body), None)
        times.append(time.perf_counter() - started)
    return {"body_mb": round(len(body) / 2**20, 1), "best_s": round(min(times), 3)}


def _log_path() -> Path:
    return Path(tempfile.mkdtemp(prefix="attacks-")) / "server.log"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ["embeddings", "shapes", "disconnects", "drain", "auth", "decoding", "decode_cost"]
    parser.add_argument("attack", choices=[*names, "all"])
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="source tree to run the server from"
    )
    parser.add_argument("--embed-chars", type=int, default=5_000_000, help="one word this long")
    args = parser.parse_args()
    chosen = names if args.attack == "all" else [args.attack]
    out: dict[str, Any] = {"root": str(args.root)}
    for name in chosen:
        if name == "embeddings":
            from service.text.tokenizer import minilm_path

            model_dir = minilm_path()
            if model_dir is None:
                out[name] = "skipped: all-MiniLM-L6-v2 is not installed"
                continue
            out[name] = embeddings(args.root, model_dir, args.embed_chars)
        else:
            out[name] = globals()[name](args.root)
        print(json.dumps({name: out[name]}, default=str), flush=True)
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
