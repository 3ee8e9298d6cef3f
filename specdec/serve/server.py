"""``specdec serve``: load the model, build the app, run uvicorn until SIGINT / SIGTERM (graceful shutdown)."""

from __future__ import annotations

import os

from specdec.config import SpeculativeConfig


def run_server(model: str, model_name: str, host: str, port: int, max_waiting: int, shutdown_timeout: float,
               speculative: SpeculativeConfig | None, log_level: str = "info", **llm_kwargs) -> None:
    """Serve ``model`` on ``host:port`` until interrupted. ``llm_kwargs`` go to ``specdec.LLM`` (dtype, device,
    max_model_len, max_num_seqs, ...). On SIGINT / SIGTERM uvicorn stops accepting connections, lets open ones
    finish for up to ``shutdown_timeout`` seconds, and the engine aborts whatever is still running."""
    import uvicorn

    from specdec import LLM
    from specdec.serve.app import build_app

    llm = LLM(model, speculative=speculative, **llm_kwargs)
    app = build_app(llm.engine, model_name, max_waiting=max_waiting, shutdown_timeout=shutdown_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=os.environ.get("SPECDEC_ACCESS_LOG") == "1")
    uvicorn.Server(config).run()
