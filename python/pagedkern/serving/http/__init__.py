"""The HTTP front end (the `serve` extra's stack: fastapi, uvicorn, pydantic): `app` (the
OpenAI-compatible routes, `serve`, `bind`), `protocol` (request and response models, the
request -> SamplingParams mapping), `streaming` (SSE and whole responses from the core's
streams), `connection` (head and body bounds, timeouts, request ids, the API key), `prompts`
(chat templates and tokenizing), `errors` (OpenAI-shaped errors) and `settings` (the server's
options, which the CLI's flags are made from). Nothing is imported here, so `settings` loads
without the HTTP stack."""
