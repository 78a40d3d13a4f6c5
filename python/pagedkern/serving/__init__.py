"""Serving: pagedkern behind a command line and an OpenAI-compatible HTTP API, in three
subpackages, each importing only the ones after it:

- `cli`: `pagedkern-serve` (its flags in `cli.args`): one prompt streamed to stdout, stdin
  requests batched, or `--http`, which starts the two processes below.
- `http`: the HTTP front end: the FastAPI app and its routes, the OpenAI protocol models, SSE
  streaming, connection limits, errors, the server's settings.
- `core`: the process boundary: the engine core (the Engine's step loop, in a process of its
  own under `--http`), the typed messages between it and the front end and the channel they
  cross, the front end's client and per-request streams, the server's metrics, and the
  `--trace` narrator of the engine's steps.
"""
