"""The server's options really reach the server and the engine:
--api-key, --allowed-origins (CORS), --served-model-name, --chat-template, the sampling flags as
the server's default sampling parameters, X-Request-Id in responses and in --trace, and the
engine flags (--enforce-eager, --no-chunked-prefill, --dtype, --device, ...) in EngineConfig."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from support.serving import ServerThread

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.serving.cli import args as cli_args
from pagedkern.serving.cli import config_from_flags
from pagedkern.serving.core.trace import TraceWriter
from pagedkern.serving.http.settings import ServerSettings

TINY = "synthetic:tiny"
WAIT = 60
CLI = [sys.executable, "-m", "pagedkern.serving.cli"]


def tiny_engine() -> Engine:
    return Engine.from_config(
        EngineConfig(model=TINY, backend="reference", device="cpu", num_blocks=256, block_size=4)
    )


def chat(text: str = "hi", **extra) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": text}], **extra}


def test_api_key_guards_v1_but_not_health():
    with ServerThread(tiny_engine(), settings=ServerSettings(api_key="sekret")) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.get(s.url + "/v1/models", headers=headers, timeout=WAIT)
            assert r.status_code == 401, headers
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and set(error) >= {"message", "type"}
        ok = {"Authorization": "Bearer sekret"}
        assert httpx.get(s.url + "/v1/models", headers=ok, timeout=WAIT).status_code == 200
        r = httpx.post(
            s.url + "/v1/chat/completions", json=chat(max_tokens=2), headers=ok, timeout=WAIT
        )
        assert r.status_code == 200
        assert httpx.get(s.url + "/health", timeout=WAIT).status_code == 200


def preflight(s: ServerThread, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(s.url + "/v1/chat/completions", headers=headers, timeout=WAIT)


def test_cors_is_off_by_default_and_allows_only_the_given_origins():
    with ServerThread(tiny_engine()) as s:
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://a.test"}, timeout=WAIT)
        assert "access-control-allow-origin" not in r.headers
        assert "access-control-allow-origin" not in preflight(s, "http://a.test").headers
    settings = ServerSettings(allowed_origins=["http://a.test"], api_key="k")
    with ServerThread(tiny_engine(), settings=settings) as s:
        r = preflight(s, "http://a.test")  # a preflight carries no key and must not be a 401
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.test"
        assert "access-control-allow-origin" not in preflight(s, "http://b.test").headers


def test_served_model_name_is_the_name_clients_use():
    with ServerThread(tiny_engine(), settings=ServerSettings(served_model_name="my-llm")) as s:
        models = httpx.get(s.url + "/v1/models", timeout=WAIT).json()
        assert [m["id"] for m in models["data"]] == ["my-llm"]
        ok = {**chat(max_tokens=1), "model": "my-llm"}
        assert httpx.post(s.url + "/v1/chat/completions", json=ok, timeout=WAIT).status_code == 200
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(max_tokens=1), timeout=WAIT)
        assert r.status_code == 404


def test_server_default_sampling_fills_what_a_request_leaves_out():
    settings = ServerSettings(default_sampling={"max_tokens": 3, "temperature": 0.0})
    with ServerThread(tiny_engine(), settings=settings) as s:
        url = s.url + "/v1/chat/completions"
        r = httpx.post(url, json=chat(ignore_eos=True), timeout=WAIT).json()
        assert r["usage"]["completion_tokens"] == 3
        r = httpx.post(url, json=chat(ignore_eos=True, max_tokens=5), timeout=WAIT).json()
        assert r["usage"]["completion_tokens"] == 5  # the request's own value wins
        greedy = [
            httpx.post(url, json=chat("same", ignore_eos=True), timeout=WAIT).json()
            for _ in range(2)
        ]
        texts = [g["choices"][0]["message"]["content"] for g in greedy]
        assert texts[0] == texts[1]  # temperature 0 from the server's defaults: greedy


def test_x_request_id_is_the_engine_request_id_in_the_trace():
    engine = tiny_engine()
    trace = io.StringIO()
    engine.tracer = TraceWriter(engine.tokenizer, out=trace)
    with ServerThread(engine) as s:
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json=chat(max_tokens=2),
            headers={"X-Request-Id": "client-7"},
            timeout=WAIT,
        )
        assert r.headers["x-request-id"] == "client-7"
        assert r.json()["id"] == "chatcmpl-client-7"
    assert "── client-7 arrives" in trace.getvalue()


def parse(*flags: str):
    return cli_args.build_parser().parse_args([*flags, "hi"])


def test_engine_flags_reach_engine_config():
    config = config_from_flags.engine_config(
        parse(
            "--enforce-eager",
            "--no-chunked-prefill",
            "--no-prefix-caching",
            "--dtype",
            "float16",
            "--device",
            "cpu",
            "--gpu-memory-fraction",
            "0.5",
            "--max-model-len",
            "64",
            "--block-size",
            "8",
        )
    )
    assert config.cuda_graphs is False and config.enable_chunked_prefill is False
    assert config.enable_prefix_caching is False and config.dtype is torch.float16
    assert (config.device, config.gpu_memory_fraction) == ("cpu", 0.5)
    assert (config.max_model_len, config.block_size) == (64, 8)
    defaults = config_from_flags.engine_config(parse())
    assert defaults == EngineConfig()  # every engine flag's default is EngineConfig's


def test_sampling_flags_become_http_defaults_only_when_given():
    flags = parse("--http", "--max-tokens", "7", "--stop", "x")
    settings = config_from_flags.server_settings(flags)
    assert settings.default_sampling == {"max_tokens": 7, "stop": ["x"]}
    assert config_from_flags.server_settings(parse("--http")).default_sampling == {}


def test_help_shows_a_default_for_every_flag():
    text = cli_args.build_parser().format_help()
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    for option in options[1:]:
        flag = option.split()[0].rstrip(",")
        if flag in ("--version", "-h"):
            continue
        body = " ".join(option.split())
        assert "default" in body or "(off)" in body, flag


def help_group_of(flag: str) -> str:
    """The title of the --help group that lists `flag`."""
    for group in cli_args.build_parser()._action_groups:
        if any(flag in action.option_strings for action in group._group_actions):
            return group.title
    raise AssertionError(f"{flag} is in no help group")


def test_derived_engine_flags_are_grouped_by_what_they_configure():
    for flag in ("--async-scheduling", "--piecewise-cuda-graphs"):
        assert help_group_of(flag).startswith("engine"), flag
    for flag in ("--speculative", "--num-speculative-tokens", "--ngram-min", "--draft-model"):
        assert help_group_of(flag).startswith("speculative decoding"), flag


def test_trace_writes_to_stderr_as_it_is_when_writing(capsys):
    """The default `out` is sys.stderr at each write, not the one of import time (this module
    imported trace.py before capsys replaced sys.stderr)."""
    engine = tiny_engine()
    engine.tracer = TraceWriter(engine.tokenizer)
    engine.add_request("hi", SamplingParams(max_tokens=1), request_id="traced-1")
    list(engine.run_until_done())
    assert "── traced-1 arrives" in capsys.readouterr().err


def test_cli_chat_template_changes_the_rendered_prompt(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    for value in (str(template), template.read_text()):
        proc = subprocess.run(
            [*CLI, "--model", TINY, "--backend", "reference", "--max-tokens", "1", "--trace"]
            + ["--chat-template", value, "hello"],
            capture_output=True,
            text=True,
            timeout=WAIT * 5,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "│ <<hello>>" in proc.stderr


def test_cli_http_options_reach_the_server():
    proc = subprocess.Popen(
        [*CLI, "--http", "--port", "0", "--model", TINY, "--backend", "reference"]
        + ["--served-model-name", "tiny-1", "--api-key", "k", "--max-tokens", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        match = re.search(r"serving 'tiny-1' at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line + proc.stderr.read()
        url = match.group(1)
        assert httpx.head(url + "/health", timeout=WAIT).status_code == 200
        assert httpx.get(url + "/v1/models", timeout=WAIT).status_code == 401
        body = {**chat(ignore_eos=True), "model": "tiny-1"}
        r = httpx.post(
            url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer k"},
            timeout=WAIT,
        )
        assert r.json()["usage"]["completion_tokens"] == 2  # --max-tokens as the default
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("value", ["{{ unclosed", "/no/such/template.jinja"])
def test_a_bad_chat_template_is_exit_2(value):
    proc = subprocess.run(
        [*CLI, "--model", TINY, "--chat-template", value, "hi"],
        capture_output=True,
        text=True,
        timeout=WAIT * 5,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--chat-template" in proc.stderr
