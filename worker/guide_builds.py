"""Structured-output matchers built off the step loop: requests parked on their grammar.

A request with a grammar waits here, as a request waits for its adapter's fetch (`parked.py`), while a
thread of a small pool builds its llguidance matcher (`GrammarMatchers.matcher`: under llguidance's
resource limits; a continued request's earlier tokens replayed) and computes its first mask once
(`GrammarMatchers.first_mask`: a costly grammar pays for its lexer there). llguidance drops the GIL for
both, so the step loop runs on meanwhile: a grammar however costly never holds a step. A finished build is
queued and wakes the step loop (`Wakeup`); the loop `take`s it and admits the request with its matcher,
or ends it with the build's error (INVALID_ARGUMENT naming structured output). The step loop itself
never builds an llguidance object.

    builds.submit(request_id, grammar, output_ids)   # start a build
    builds.take()                                    # -> the builds that finished, each once
    builds.cancel(request_id)                        # the request ended first: its build is forgotten
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.worker.fetch_threads import Wakeup
from loraserve.worker.grammar import FIELD, GrammarMatchers, MaskComputer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltGuide:
    """A build's outcome: the matcher, at the end of the request's earlier tokens and with its first mask
    computed once, or the error to end the request with."""

    request_id: str
    matcher: Any = None  # llguidance.LLMatcher
    error: LoraserveError | None = None
    seconds: float = 0.0


class GuideBuilds:
    """The pool that builds matchers, and the requests waiting on it (see the module docstring)."""

    def __init__(self, grammars: GrammarMatchers, wakeup: Wakeup, threads: int = 2):
        self.grammars, self._wakeup = grammars, wakeup
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="grammar-build")
        self._building: dict[str, concurrent.futures.Future] = {}  # request id -> its build (step loop only)
        self._done: queue.SimpleQueue[BuiltGuide] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, request_id: str, grammar: str, output_ids: list[int]) -> None:
        self._building[request_id] = self._pool.submit(self._build, request_id, grammar, list(output_ids))

    def cancel(self, request_id: str) -> None:
        """Forget the request's build (a build under way runs out on its thread; its result is dropped)."""
        future = self._building.pop(request_id, None)
        if future is not None:
            future.cancel()

    def take(self) -> list[BuiltGuide]:
        """The builds that finished since the last call, for requests still waiting on them."""
        built = []
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                return built
            if self._building.pop(result.request_id, None) is not None:
                built.append(result)

    def warm_up(self, masks: MaskComputer) -> None:
        """Build the llguidance tokenizer and one small matcher with its mask on the pool, then a mask on the
        step's mask computer (`masks`), so the first structured request pays for no lazy initialization."""
        try:
            matcher = self._pool.submit(self._warm).result()
        except Exception:  # the worker still serves; each structured request then fails alone, saying why
            log.exception("structured output could not be prepared (llguidance with this model's tokenizer)")
            return
        masks.wait(masks.start([matcher]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the pool's threads ----------------------------------------------------------------------
    def _build(self, request_id: str, grammar: str, output_ids: list[int]) -> None:
        started = time.perf_counter()
        try:
            matcher = self.grammars.matcher(grammar, output_ids)
            self.grammars.first_mask(matcher)
            result = BuiltGuide(request_id, matcher, seconds=time.perf_counter() - started)
        except LoraserveError as e:
            result = BuiltGuide(request_id, error=e, seconds=time.perf_counter() - started)
        except Exception as e:  # llguidance raises for misuse, not for a user's grammar: still only this request's
            log.exception("request %s: building its structured-output matcher failed", request_id)
            error = InvalidRequestError(FIELD, f"the constraint could not be prepared ({type(e).__name__}: {e})")
            result = BuiltGuide(request_id, error=error, seconds=time.perf_counter() - started)
        with self._lock:
            if self._closed:
                return
            self._done.put(result)
        self._wakeup.wake()

    def _warm(self) -> Any:
        from llguidance import LLMatcher

        seconds = self.grammars.prepare()
        matcher = self.grammars.matcher(LLMatcher.grammar_from_regex("[a-z]{1,8}"), [])
        self.grammars.first_mask(matcher)
        log.info("structured output ready: llguidance tokenizer built in %.2f s", seconds)
        return matcher
