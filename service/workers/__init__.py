"""`--workers N > 1`: one engine process behind N front-end processes on one port.

- `supervisor`: starts, restarts and drains the processes.
- `engine`: the engine process (models, batchers, engine threads) serving the front-ends.
- `frontend`: a front-end's lifespan; `remote`: its link to the engine, and the batcher and
  statistics that forward there.
- `messages`: every message on the channel, as a type.
- `wire`, `channel`, `slab`: what crosses (payloads in shared memory, small pickled messages).
"""
