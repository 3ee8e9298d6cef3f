"""``specdec serve``: load the model, build the app, run uvicorn until SIGINT / SIGTERM (graceful shutdown)."""

from __future__ import annotations

import os

from specdec.config import SpeculativeConfig


def run_server(model: str, model_name: str, host: str, port: int, max_waiting: int, shutdown_timeout: float,
               speculative: SpeculativeConfig | None, log_level: str = "info", api_key: str | list[str] | None = None,
               allowed_origins: list[str] | None = None, access_log: bool = False,
               request_timeout: float | None = None, chat_template: str | None = None, **llm_kwargs) -> list[int]:
    """Serve ``model`` on ``host:port`` until interrupted. ``llm_kwargs`` go to ``specdec.LLM`` (dtype, device,
    max_model_len, max_num_seqs, ...); ``api_key`` / ``allowed_origins`` / ``request_timeout`` / ``chat_template``
    go to ``build_app``; ``access_log``: uvicorn's access log (also with ``SPECDEC_ACCESS_LOG=1``). On SIGINT / SIGTERM
    uvicorn stops accepting connections, lets open ones finish for up to ``shutdown_timeout`` seconds, and the engine
    aborts whatever is still running. Returns the signals that stopped the server (uvicorn re-raises them once shut
    down; a SIGINT then surfaces as ``KeyboardInterrupt`` - unless a library replaced Python's SIGINT handler
    meanwhile, hence the return)."""
    import uvicorn

    from specdec import LLM
    from specdec.serve.app import build_app

    llm = LLM(model, speculative=speculative, **llm_kwargs)
    app = build_app(llm.engine, model_name, max_waiting=max_waiting, shutdown_timeout=shutdown_timeout,
                    api_key=api_key, allowed_origins=allowed_origins, request_timeout=request_timeout,
                    chat_template=chat_template)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=access_log or os.environ.get("SPECDEC_ACCESS_LOG") == "1")
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any
    return list(getattr(server, "_captured_signals", []))  # uvicorn's record of the signals it handled
