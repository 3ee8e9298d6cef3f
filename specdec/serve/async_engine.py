"""AsyncEngine: one background thread steps an ``LLMEngine``; asyncio callers add requests and read their outputs.

Why a dedicated thread (and not an asyncio task that runs each step in a worker thread):

- ``LLMEngine`` is not thread-safe, and torch keeps per-thread state (thread count, grad mode). A worker pool
  (``asyncio.to_thread``) may run successive steps on different threads; one thread owned by the engine runs
  every engine call - ``add_request``, ``step``, ``abort`` and every read of its state - on the same thread.
- The event loop never waits for a step: HTTP parsing, SSE writes and disconnect detection go on while the
  model computes, and the GIL is released inside torch's kernels.
- Nothing spins: with no unfinished request the thread blocks on its command queue (``queue.get()``), and a
  new command (add, abort, stop) wakes it. Between steps it drains the queue without blocking.

The asyncio side talks to the thread only through that queue (commands are closures run on the thread) and
the thread talks back only through ``loop.call_soon_threadsafe`` (outputs into each request's asyncio queue).
Outputs are cumulative (vLLM-style): a verification round that accepts several tokens arrives as one output
with several new tokens; a slow reader gets only the latest output, never a stale backlog.

Over 300 lines: the thread's loop, its commands and the asyncio streams form one protocol whose halves must be
read together (which side may touch what, and when).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdec.engine.engine import LLMEngine
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.params import SamplingParams


class QueueFullError(Exception):
    """The waiting queue is full (HTTP 503 with Retry-After)."""


class ShuttingDownError(Exception):
    """The engine no longer accepts requests (HTTP 503)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state read on the loop thread after each iteration (what /metrics and /health show)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # engine counters (tokens looked up / served from the prefix cache)
    prefix_cache_hits: int = 0
    loop_alive: bool = True


@dataclass
class _Stream:
    """One request's channel to its asyncio reader. ``queue`` lives on the event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_tokens_seen: int = 0  # generated tokens already counted in the metrics (loop thread only)
    prompt_counted: bool = False
    seq_metrics: object = None  # the engine Sequence's RequestMetrics (exact per-position counts), if found


class RequestStream:
    """Async iterator over one request's cumulative ``RequestOutput``s, ending with the finished one.

    Leaving the iteration early (client gone, task cancelled) aborts the request: its blocks are freed at once.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self._stream.queue.get()
                while not out.finished and not self._stream.queue.empty():  # coalesce: outputs are cumulative
                    out = self._stream.queue.get_nowait()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    """Continuous batching for asyncio callers over one ``LLMEngine`` (see the module docstring).

    Args:
        engine: the engine; after ``start()`` only the loop thread touches it.
        max_waiting: at most ``engine.config.max_num_seqs + max_waiting`` requests (each of ``n`` samples
            counted) are unfinished at once; an ``add`` beyond that raises ``QueueFullError``.
        metrics: optional observer with ``on_output(out, new_prompt_tokens, new_tokens)``,
            ``on_finished(out, request_metrics)`` and ``on_snapshot(snapshot)``, called on the loop thread.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 64, metrics=None):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._flush = False  # an abort's output waits in the engine: step once even if nothing runs
        self._accepting = True
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None  # set on the event loop when no stream is open
        self.snapshot = EngineSnapshot(kv_blocks_total=engine.block_manager.num_blocks)
        self.loop_error: str | None = None  # why the loop thread stopped, if it died

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (call from inside the event loop that will read the streams)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="specdec-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to ``timeout`` seconds, abort the rest (their
        streams end with ``finish_reason "abort"``), then stop the loop thread."""
        self._accepting = False
        if self._thread is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._commands.put(self._abort_all)
        self._commands.put(None)  # stop
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # --- requests (event loop side) ----------------------------------------------------------------------------
    async def add(self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None,
                  fill_max_tokens: bool = False, tenant: str | None = None) -> RequestStream:
        """Queue a request on the loop thread; returns its stream. Raises ``ValueError`` (bad request, checked
        by ``LLMEngine.add_request``), ``QueueFullError`` or ``ShuttingDownError``.

        ``fill_max_tokens``: set ``max_tokens`` to what the context has left after the prompt (OpenAI chat's
        default when the request gives none).
        """
        if not self._accepting or not self.is_alive:
            raise ShuttingDownError("the server is shutting down" if not self._accepting else
                                    f"the engine loop is not running ({self.loop_error})")
        loop = asyncio.get_running_loop()
        request_id = f"{self._prefix}-{next(self._ids)}"
        stream = _Stream(loop, asyncio.Queue())
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the caller went away before the command ran
            try:
                done.set_result(self._add_on_loop(request_id, stream, prompt, params, prompt_token_ids,
                                                  fill_max_tokens, tenant))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._idle.clear()
        self._commands.put(command)
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            self.abort(request_id)  # cancelled after the command ran: do not leak the request
            self._loop_check_idle()
            raise
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored). Safe from any thread."""
        self._commands.put(lambda: self._abort_on_loop(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the loop thread between steps and return its result (tests, diagnostics)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001
                done.set_exception(e)

        self._commands.put(command)
        return await asyncio.wrap_future(done)

    def call_sync(self, fn: Callable[[LLMEngine], object], timeout: float | None = 30.0) -> object:
        """``call`` for a caller outside the event loop (a test thread): blocks until the loop thread ran it."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001
                done.set_exception(e)

        self._commands.put(command)
        return done.result(timeout)

    # --- the loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests() or self._flush
                try:
                    command = self._commands.get(block=not busy)  # idle: sleep until a command arrives
                except queue.Empty:
                    command = None
                else:
                    while True:
                        if command is None:
                            return
                        command()
                        try:
                            command = self._commands.get_nowait()
                        except queue.Empty:
                            break
                if self.engine.has_unfinished_requests() or self._flush:
                    self._flush = False
                    self._step()
                self._publish()
        except BaseException as e:  # a bug in the loop itself: end every stream, never leave a client hanging
            self.loop_error = f"{type(e).__name__}: {e}"
            self._fail_all(self.loop_error)
            raise
        finally:
            self.snapshot = dataclasses.replace(self.snapshot, loop_alive=False)

    def _add_on_loop(self, request_id, stream, prompt, params, prompt_token_ids, fill_max_tokens, tenant) -> None:
        engine = self.engine
        unfinished = len(engine.scheduler.waiting) + len(engine.scheduler.running)
        if unfinished + _num_samples(params) > self.capacity:
            raise QueueFullError(f"{unfinished} requests are in flight and the server takes at most "
                                 f"{self.capacity} (max_num_seqs {engine.config.max_num_seqs} + max_waiting "
                                 f"{self.max_waiting}); retry later")
        if fill_max_tokens:
            if prompt_token_ids is None:
                if engine.tokenizer is None:
                    raise ValueError("this model has no tokenizer: give prompt token ids")
                prompt_token_ids = engine.tokenizer.encode(prompt)
            room = engine.config.max_model_len - len(prompt_token_ids)
            if room < 1:
                raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within "
                                 f"max_model_len={engine.config.max_model_len}; shorten the prompt")
            params = dataclasses.replace(params, max_tokens=room)
        engine.add_request(prompt, params, prompt_token_ids, request_id=request_id, tenant=tenant)
        waiting = engine.scheduler.waiting
        if waiting and getattr(waiting[-1], "request_id", None) == request_id:
            stream.seq_metrics = waiting[-1].metrics
        self._streams[request_id] = stream

    def _abort_on_loop(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._flush = True
            self._dispatch([out])

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort_on_loop(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine isolates request failures; this is an engine bug
            message = f"the engine step failed: {type(e).__name__}: {e}"
            for request_id in list(self._streams):
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001, S110 - the stream is ended below either way
                    pass
            self._fail_all(message)
            self._flush = True
            return
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # an abort already reported to its reader
            if self.metrics is not None:
                tokens = sum(len(c.token_ids) for c in out.outputs)
                prompt = 0 if stream.prompt_counted else len(out.prompt_token_ids)
                stream.prompt_counted = True
                self.metrics.on_output(out, prompt, tokens - stream.num_tokens_seen)
                stream.num_tokens_seen = tokens
                if out.finished:
                    self.metrics.on_finished(out, stream.seq_metrics)
            if out.finished:
                del self._streams[out.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        self._loop_check_idle()

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            out = RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "error")], True, {}, message)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        self._streams.clear()
        self._loop_check_idle()

    def _loop_check_idle(self) -> None:
        """Tell the event loop when no stream is open (graceful shutdown waits for it). Any thread."""
        if not self._streams and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._set_idle_if_empty)

    def _set_idle_if_empty(self) -> None:
        if not self._streams:
            self._idle.set()

    def _publish(self) -> None:
        engine = self.engine
        bm = engine.block_manager
        stats = engine.stats
        self.snapshot = EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_total=bm.num_blocks,
            prefix_cache_queries=stats.get("prefix_cache_queries", 0),
            prefix_cache_hits=stats.get("prefix_cache_hits", 0),
        )
        if self.metrics is not None:
            self.metrics.on_snapshot(self.snapshot)


def _num_samples(params: SamplingParams) -> int:
    """How many sequences a request becomes (``n`` where SamplingParams has it)."""
    return int(getattr(params, "n", 1) or 1)
