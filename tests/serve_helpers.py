"""An in-process ``specdec serve`` (uvicorn in a thread, on a free port of 127.0.0.1) for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from helpers import small_llm

from specdec.serve.app import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """``build_app`` over a fresh ``specdec.LLM`` served by uvicorn in a daemon thread."""

    def __init__(self, model: str, name: str = "tiny", max_waiting: int = 64, shutdown_timeout: float = 5.0,
                 app_kwargs: dict | None = None, **llm_kwargs):
        self.llm = small_llm(model, **llm_kwargs)
        self.name = name
        self.app = build_app(self.llm.engine, name, max_waiting=max_waiting, shutdown_timeout=shutdown_timeout,
                             **(app_kwargs or {}))
        self.async_engine = self.app.state.async_engine
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not shut down"

    def client(self, api_key: str = "none", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def async_client(self):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=60)

    def engine_state(self) -> dict:
        """Read on the engine loop thread: unfinished requests and free / total KV blocks of every pool (target,
        and the draft model's); unreferenced prefix-cache blocks count as free."""
        def read(engine):
            pools = list(engine.block_managers)  # the target's pool, then the draft model's
            return {"unfinished": engine.has_unfinished_requests(), "free": sum(p.num_free_blocks for p in pools),
                    "total": sum(p.num_blocks for p in pools), "pools": len(pools)}

        return self.async_engine.call_sync(read)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Engine state once no request is unfinished and every block is free (or what it is at ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if (not state["unfinished"] and state["free"] == state["total"]) or time.monotonic() > deadline:
                return state
            time.sleep(0.02)


class Http:
    """Plain HTTP (stdlib ``http.client``) for what the openai client cannot show: raw status and headers,
    reading part of a stream and then disconnecting."""

    def __init__(self, server: ServerThread, timeout: float = 30):
        self.server, self.timeout = server, timeout

    def _conn(self):
        import http.client

        return http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=self.timeout)

    def post(self, path: str, body: dict | bytes) -> tuple[int, dict, dict]:
        """(status, headers with lower-case names, JSON body) of a non-streamed POST."""
        import json

        conn = self._conn()
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        conn = self._conn()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode()
        finally:
            conn.close()

    def stream(self, path: str, body: dict):
        """An open streaming POST: (connection, response); ``events(response)`` reads its SSE data lines and
        ``connection.close()`` disconnects."""
        import json

        conn = self._conn()
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def open(self, path: str, body: dict):
        """Send a POST and return (connection, None) without reading the answer: ``connection.close()`` leaves."""
        import json

        conn = self._conn()
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return conn, None

    @staticmethod
    def events(response):
        """SSE ``data:`` payloads as they arrive (strings; ``[DONE]`` included)."""
        while True:
            line = response.readline()
            if not line:
                return
            line = line.decode().strip()
            if line.startswith("data:"):
                yield line[5:].strip()
