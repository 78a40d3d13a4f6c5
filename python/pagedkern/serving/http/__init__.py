"""The HTTP front end (the `serve` extra's stack: fastapi, uvicorn, pydantic): `app` (the
app's assembly and `serve`), `routes` (the OpenAI-compatible handlers), `server` (uvicorn and
`bind`), `error_mapping` (refusals and failures as OpenAI errors), `request_parsing` (a body parsed,
its SamplingParams checked: 400s naming the field), `request_models` (the requests' models, the
request -> SamplingParams mapping), `response_models` (the responses' models), `body_formats` (a
response's JSON chunks and whole body), `streaming` (a stream's SSE events),
`event_stream_response` (the ASGI response carrying them), `whole_response` (a non-streaming
answer gathered), `merged_streams` (several request streams read as one), `connection` (head and
body bounds, timeouts, request ids, the API key), `prompts` (chat templates and tokenizing),
`errors` (OpenAI-shaped errors) and `settings` (the server's options, which the CLI's flags are
made from). Nothing is imported here, so `settings` loads without the HTTP stack."""
