"""mha-serve: the HTTP service (Open Inference Protocol v2) in front of mha_engine."""

__version__ = "0.1.0"
