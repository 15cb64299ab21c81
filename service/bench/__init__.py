"""Service benchmarks: `python -m service.bench`."""
