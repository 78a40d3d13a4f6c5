"""The front end <-> engine core boundary: `messages` (the typed messages both sides send,
defined once), `channel` (their msgpack frames over one duplex connection), `engine_core` (the
Engine's loop behind the channel: a process of its own under `pagedkern-serve --http`, or a
thread), `core_process` (that process: started, loaded, its threads, its exit),
`engine_client` (the front end's handle on it: requests out, deltas fanned out to
`request_stream`s, which detokenize and match stop strings; what it raises in `client_errors`,
its ordered sends in `core_outbox`, its `open_requests` by id, its `step_watchdog`), `metrics`
(the front end's counters and histograms, rendered as Prometheus text) and `trace` (the
--trace narrator of the engine's steps)."""
