"""Load testing for mha-serve with Locust: locustfile, load shapes, headless runner and sweep.

Only `locustfile.py` and `shapes/` import Locust (which monkey-patches with gevent); the other
modules are plain Python so tests and tools can import them safely.
"""
