"""HTTP routers, one module per concern."""
