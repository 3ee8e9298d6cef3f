"""``specdec serve`` as a user starts it: the real CLI in a subprocess, the openai client, then SIGINT (uvicorn
shuts down gracefully and re-raises the interrupt: the CLI exits 130, as for any Ctrl-C). Started the way a vLLM user
would start it: ``--model``, vLLM's ``--speculative-config`` JSON and ``--api-key``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from serve_helpers import free_port

import specdec
from specdec.cli.parser import api_keys


def test_cli_serve_completions_chat_and_sigint(tiny_pair, tiny_pair_plain):
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "specdec", "serve", "--model", tiny_pair[0], "--port", str(port),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256", "--threads", "1",
           "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
           "--api-key", "k3y", "--allowed-origins", "http://a.example,http://b.example"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert json.loads(r.read()) == {"status": "ok"}
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.1)
        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        try:
            stranger.models.list()
            raise AssertionError("a request without the API key was served")
        except openai.AuthenticationError:
            pass
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt="the cat sat on the", max_tokens=16, temperature=0)
        ref = tiny_pair_plain.generate("the cat sat on the", specdec.SamplingParams(temperature=0, max_tokens=16))[0]
        assert got.choices[0].text == ref.outputs[0].text
        messages = [{"role": "user", "content": "in the tin"}]
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True))
        assert text == tiny_pair_plain.chat(messages, specdec.SamplingParams(temperature=0, max_tokens=12))[0] \
            .outputs[0].text
        proc.send_signal(signal.SIGINT)  # graceful shutdown, then the CLI's Ctrl-C exit code
        assert proc.wait(timeout=30) == 130
        assert "Application shutdown complete" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_rejects_bad_options_before_loading():
    """Bad speculative options fail like ``generate``'s: exit code 2 and a message, no model load."""
    out = subprocess.run([sys.executable, "-m", "specdec", "serve", "--draft-model", "x", "--port", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--draft-model needs" in out.stderr


def test_cli_serve_without_the_serve_extra_says_how_to_install(monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ModuleNotFoundError
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "uvicorn is missing" in err and "specdec[serve]" in err


def test_serve_options_parse():
    from specdec.cli import build_parser
    from specdec.cli.parser import allowed_origins

    assert allowed_origins(None) is None
    assert allowed_origins('["http://a", "*"]') == ["http://a", "*"]
    assert allowed_origins("http://a, http://b") == ["http://a", "http://b"]
    for bad in ("[1]", "[", " , "):
        try:
            allowed_origins(bad)
            raise AssertionError(f"{bad!r} was accepted")
        except ValueError:
            pass
    args = build_parser().parse_args(["serve", "--api-key", "x", "--access-log"])
    assert api_keys(args.api_key) == ["x"] and args.access_log is True
    args = build_parser().parse_args(["serve", "--api-key", "x", "--api-key", "y"])
    assert api_keys(args.api_key) == ["x", "y"]  # several keys, each its own tenant


def test_serve_api_key_defaults_to_the_environment(monkeypatch):
    from specdec.cli import build_parser

    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert api_keys(build_parser().parse_args(["serve"]).api_key) == ["from-env"]
    assert api_keys(build_parser().parse_args(["serve", "--api-key", "given"]).api_key) == ["given"]
    monkeypatch.delenv("SPECDEC_API_KEY")
    assert api_keys(build_parser().parse_args(["serve"]).api_key) is None
