"""HTTP front: uvicorn server and connection limits, ASGI middleware, /docs, OpenAPI, routes."""
