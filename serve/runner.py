"""The engine's thread and the bridge to asyncio.

All torch work happens in one background thread (`EngineRunner`), which runs `Engine.run`. Request
handlers submit from the event loop; the engine calls each request's listener from its thread, and the
listener hands the event to the handler's asyncio queue with `call_soon_threadsafe` (never blocking the
engine on a slow client: the queue is unbounded and holds at most one request's tokens).
"""
from __future__ import annotations

import asyncio
import logging
import threading

from specbatch.runtime.engine import Engine, Event, Request

log = logging.getLogger("specbatch.serve")


class EventStream:
    """One request's events, delivered into the event loop that created it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def push(self, event: Event) -> None:  # the engine's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self) -> Event:
        return await self.queue.get()


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drain_timer: threading.Timer | None = None

    @property
    def draining(self) -> bool:
        """Shutting down: no new requests, in-flight ones finish (or are cancelled after the drain time)."""
        return self._drain_timer is not None

    @property
    def idle(self) -> bool:
        return self.engine.running == 0 and self.engine.waiting == 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.engine.run, args=(self._stop,), name="specbatch-engine",
                                            daemon=True)
            self._thread.start()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> EventStream:
        """Queue a request (raises the engine's QueueFull, EngineClosed, EngineError)."""
        stream = EventStream(loop)
        self.engine.submit(Request(request.id, request.prompt_ids, request.max_tokens, request.sampling,
                                   request.seed, request.stop, stream.push))
        return stream

    def begin_shutdown(self, drain_s: float) -> None:
        """Take no new requests; give running and waiting ones `drain_s` seconds, then cancel the rest
        (each gets a final event, so no stream is left half-written)."""
        self.engine.close()
        if self._drain_timer is None:
            log.info("shutting down: new requests get 503; in-flight ones have %.0f s to finish", drain_s)
            self._drain_timer = threading.Timer(drain_s, self.engine.cancel_all_soon)
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (after `begin_shutdown`, or at once), ending whatever is left as cancelled."""
        self.engine.close()
        self.engine.cancel_all_soon()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if not self.alive:
            self.engine.cancel_all()  # nothing left normally; after a failed join, whatever is stuck
        if self._drain_timer is not None:
            self._drain_timer.cancel()

