"""``specdec serve`` as a user starts it: the real CLI in a subprocess, the openai client, then SIGINT (uvicorn
shuts down gracefully and re-raises the interrupt: the CLI exits 130, as for any Ctrl-C)."""

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


def test_cli_serve_completions_chat_and_sigint(tiny_pair, tiny_pair_plain):
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "specdec", "serve", tiny_pair[0], "--port", str(port), "--served-model-name", "tiny",
           "--dtype", "float32", "--max-model-len", "256", "--threads", "1", "--speculative-method", "prompt_lookup",
           "--num-speculative-tokens", "3"]
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
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
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
