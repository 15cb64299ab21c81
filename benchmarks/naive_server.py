"""The baseline the service is measured against: the FastAPI server people write first.

A pydantic `list[list[list[float]]]` body, one PyTorch forward per request, JSON floats back.
Run: `python -m benchmarks.naive_server --port 8001` (serves the demo module's weights).
"""

from __future__ import annotations

import argparse

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

import mha_engine


class NaiveRequest(BaseModel):
    input: list[list[list[float]]]  # (B, T, E)


def create_naive_app() -> FastAPI:
    app = FastAPI()
    module = mha_engine.demo_module().eval()

    @app.post("/predict")
    def predict(request: NaiveRequest) -> dict[str, list]:
        with torch.inference_mode():
            output = module(torch.tensor(request.input))  # (B, T, E)
        return {"output": output.tolist()}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(create_naive_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
