"""The HTTP front end (the `serve` extra's stack: fastapi, uvicorn, pydantic): `app` (the
app's assembly and `serve`), `routes` (the OpenAI-compatible handlers), `server` (uvicorn and
`bind`), `error_mapping` (refusals and failures as OpenAI errors), `request_parsing` (a body parsed,
its SamplingParams checked: 400s naming the field), `protocol` (request and response models, the
request -> SamplingParams mapping), `streaming` (SSE and whole responses from the core's
streams), `connection` (head and body bounds, timeouts, request ids, the API key), `prompts`
(chat templates and tokenizing), `errors` (OpenAI-shaped errors) and `settings` (the server's
options, which the CLI's flags are made from). Nothing is imported here, so `settings` loads
without the HTTP stack."""
