"""The gateway's constraint sandbox: structured-output constraints compiled and checked in child processes.

Compiling a constraint runs llguidance's native code on the caller's input. Some inputs crash it (a
Lark grammar of a few thousand chained rules overflows its stack: SIGSEGV), others keep it busy or
grow it without bound; in the gateway's own process any of them would take every call down. So the
gateway compiles nowhere but here: `await sandbox.compile(constraint)` sends the constraint to one of
a few child processes (`constraint_child.py`), which compiles it, checks it against the model's
tokenizer (`constraint_check.py`) and answers its grammar, or why not. A child's death (a crash, its
memory bound) or a compile slower than `--constraint-timeout` (the child is killed) refuses that
constraint alone, INVALID_ARGUMENT naming its field, and the child is replaced; the event loop only
waits on a socket meanwhile.

Owned here: the children (`--constraint-workers`, each under `--constraint-memory-mib`), the bound on
distinct constraints compiling or waiting for a child (`--constraint-queue`: one more is refused
RESOURCE_EXHAUSTED with a retry hint), and the outcomes of the latest constraints, grammars and
refusals alike, by a hash of their kind and text (`--constraint-cache`): a repeated constraint, poison
or the usual tool schema, is compiled once. Requests asking for the same constraint at once share
one compile. One child, seen from here: `constraint_process.py`; the wire: `constraint_wire.py`
(msgpack frames over a socket pair, nothing pickled).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError, InvalidRequestError, UnavailableError
from loraserve.gateway.constraint_process import CompilerProcess
from loraserve.gateway.constraint_wire import Compile, Compiled, Refused, Start, frame
from loraserve.gateway.events import RetryLaterError
from loraserve.log_limit import RateLimitedLog
from loraserve.structured import MAX_CONSTRAINT_BYTES, Constraint

log = logging.getLogger(__name__)
rate_limited = RateLimitedLog(log)

BUSY_RETRY_S = 1.0
MIB = 1 << 20
MIN_MEMORY_MIB = 64  # below this not even the interpreter starts


@dataclass(frozen=True)
class ConstraintConfig:
    constraint_workers: int = setting(
        2, "processes that compile and check structured-output constraints (the gateway's sandbox)"
    )
    constraint_queue: int = setting(
        64, "distinct constraints that may wait for a compiler process; one more is refused RESOURCE_EXHAUSTED"
    )
    constraint_timeout: float = setting(
        2.0, "seconds a constraint may take to compile and check; slower is refused (400) and its process replaced"
    )
    constraint_memory_mib: int = setting(
        2048, "address-space limit of each compiler process, MiB (0: none); a constraint needing more is refused"
    )
    constraint_cache: int = setting(
        256, "constraint outcomes (grammars of up to 128 KiB, refusals) remembered by hash; 0: none"
    )

    def __post_init__(self) -> None:
        if self.constraint_workers < 1:
            raise InvalidConfigError(f"--constraint-workers must be at least 1, got {self.constraint_workers}")
        if self.constraint_queue < 0:
            raise InvalidConfigError(f"--constraint-queue must be 0 or more, got {self.constraint_queue}")
        if not 0 < self.constraint_timeout <= 600:
            raise InvalidConfigError(f"--constraint-timeout must be in (0, 600] seconds, got {self.constraint_timeout}")
        if self.constraint_memory_mib != 0 and self.constraint_memory_mib < MIN_MEMORY_MIB:
            raise InvalidConfigError(
                f"--constraint-memory-mib must be 0 (none) or at least {MIN_MEMORY_MIB}, "
                f"got {self.constraint_memory_mib}"
            )
        if self.constraint_cache < 0:
            raise InvalidConfigError(f"--constraint-cache must be 0 or more, got {self.constraint_cache}")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a child builds its LLTokenizer from (the model's, as its workers build theirs)."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class ConstraintsBusyError(RetryLaterError):
    """Every compiler process is busy and the queue in front of them is full."""


class ConstraintSandbox:
    """Compiles constraints in child processes, for the event loop: `await compile(constraint)`."""

    def __init__(self, tokenizer: TokenizerSpec, config: ConstraintConfig | None = None):
        self.config = config or ConstraintConfig()
        memory = self.config.constraint_memory_mib * MIB
        start = Start(tokenizer.tokenizer_json, tokenizer.vocab_size, list(tokenizer.eos_token_ids), memory)
        self._start_frame = frame(start)
        self._children: set[CompilerProcess] = set()  # alive, idle or busy
        self._idle: list[CompilerProcess] = []
        self._slots = 0  # children alive or starting, at most constraint_workers
        self._returned = asyncio.Condition()  # a child was given back, or a slot freed
        self._inflight: dict[bytes, asyncio.Future] = {}  # compiling or waiting for a child, by key
        self._outcomes: OrderedDict[bytes, Compiled | Refused] = OrderedDict()  # least recent first
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.stats = {"compiled": 0, "refused": 0, "crashed": 0, "timed_out": 0, "cache_hits": 0, "started": 0}

    async def start(self) -> None:
        """Start every child now; InvalidConfigError if one cannot start (a memory bound too low, say)."""
        self._slots += self.config.constraint_workers
        started = await asyncio.gather(
            *(self._spawn() for _ in range(self.config.constraint_workers)), return_exceptions=True
        )
        failed = next((e for e in started if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.close()
            raise InvalidConfigError(
                f"{failed}: is --constraint-memory-mib {self.config.constraint_memory_mib} enough for this tokenizer?"
            )
        self._idle.extend(started)
        log.info(
            "constraint sandbox: %d processes (pids %s), %d MiB each, %g s per constraint, %d waiting at most",
            len(started),
            ", ".join(str(c.pid) for c in started),
            self.config.constraint_memory_mib,
            self.config.constraint_timeout,
            self.config.constraint_queue,
        )

    async def compile(self, constraint: Constraint) -> str:
        """The constraint's grammar, compiled and checked in a child. InvalidRequestError naming its field
        when it is refused; ConstraintsBusyError when too many wait; UnavailableError when no child starts."""
        job = _job(constraint)
        key = _key(job)
        outcome = self._outcomes.get(key)
        if outcome is not None:
            self._outcomes.move_to_end(key)
            self.stats["cache_hits"] += 1
        else:  # shielded: a caller that goes away leaves the compile to the others (and to the cache)
            outcome = await asyncio.shield(self._compiling(key, job))
        if isinstance(outcome, Refused):
            raise InvalidRequestError(constraint.field, outcome.reason)
        if isinstance(outcome, str):
            raise UnavailableError(outcome)
        return outcome.grammar

    async def close(self) -> None:
        """Stop every child (the gateway is stopping); compiles in flight end UNAVAILABLE."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for child in list(self._children):
            child.kill()
            await child.death()
        self._children.clear()
        self._idle.clear()

    @property
    def pids(self) -> list[int]:
        """The children's process ids."""
        return sorted(c.pid for c in self._children)

    # ---- compiles ---------------------------------------------------------------------------------
    def _compiling(self, key: bytes, job: Compile) -> asyncio.Future:
        """The future of the compile of `job`: the one running for the same key, or a new one."""
        future = self._inflight.get(key)
        if future is not None:
            return future
        most = self.config.constraint_workers + self.config.constraint_queue
        if len(self._inflight) >= most:
            raise ConstraintsBusyError(
                f"{len(self._inflight)} structured-output constraints are compiling or waiting "
                f"(--constraint-queue {self.config.constraint_queue}): retry in {BUSY_RETRY_S:g} s",
                int(BUSY_RETRY_S * 1000),
            )
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        self._background(self._run(key, job, future), "constraint-compile")
        return future

    async def _run(self, key: bytes, job: Compile, future: asyncio.Future) -> None:
        """Compile `job` in a child and settle `future` with the outcome: Compiled, Refused, or (no child
        could start, or the gateway is stopping) the reason as text."""
        child, outcome = None, "the gateway is stopping"
        try:
            child = await self._checkout()
            outcome = await self._ask(child, job)
        except UnavailableError as e:
            outcome = str(e)
        finally:
            del self._inflight[key]
            if not future.done():
                future.set_result(outcome)
        if isinstance(outcome, Compiled | Refused):
            self._remember(key, outcome)
        if child is not None:
            await self._checkin(child)

    async def _ask(self, child: CompilerProcess, job: Compile) -> Compiled | Refused:
        timeout = self.config.constraint_timeout
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                reply = await child.ask(job)
        except TimeoutError:
            child.kill()
            self.stats["timed_out"] += 1
            rate_limited.warning(child.pid, "constraint timeout", "a %s constraint took over %g s", job.kind, timeout)
            return Refused(f"took longer than {timeout:g} s to compile: simplify it")
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, msgspec.DecodeError):
            death = await child.death()
            self.stats["crashed"] += 1
            rate_limited.warning(child.pid, "constraint crash", "a %s constraint stopped it (%s)", job.kind, death)
            return Refused(
                f"could not be compiled: it stopped the compiler process ({death}): simplify it "
                "(fewer nested or chained rules, smaller repetitions)"
            )
        if not isinstance(reply, Compiled | Refused):
            child.kill()
            return Refused(f"could not be compiled: the compiler answered {type(reply).__name__}")
        self.stats["compiled" if isinstance(reply, Compiled) else "refused"] += 1
        log.debug("constraint %s: %s in %.3f s", job.kind, type(reply).__name__, time.monotonic() - started)
        return reply

    def _remember(self, key: bytes, outcome: Compiled | Refused) -> None:
        if self.config.constraint_cache == 0:
            return
        self._outcomes[key] = outcome
        self._outcomes.move_to_end(key)
        while len(self._outcomes) > self.config.constraint_cache:
            self._outcomes.popitem(last=False)

    # ---- children ---------------------------------------------------------------------------------
    async def _checkout(self) -> CompilerProcess:
        """An idle child that is alive: one waiting, a new one where a slot has none (its child died idle,
        or could not start), or the next one given back."""
        async with self._returned:
            while True:
                while not self._idle and self._slots >= self.config.constraint_workers and not self._closed:
                    await self._returned.wait()
                if self._closed:
                    raise UnavailableError("the gateway is stopping")
                if not self._idle:
                    break
                child = self._idle.pop()
                if child.alive:
                    return child
                self._children.discard(child)  # died while idle (killed from outside): not this constraint's doing
                self._background(child.death(), "constraint-reap")
                self._slots -= 1
            self._slots += 1
        try:
            return await self._spawn()
        except UnavailableError:
            await self._free_slot()
            raise

    async def _checkin(self, child: CompilerProcess) -> None:
        """Give a child back; one that died or was killed is replaced at once (its slot is freed if the
        new one cannot start: the next checkout tries again)."""
        if not child.alive:
            self._children.discard(child)
            self._background(child.death(), "constraint-reap")
            try:
                child = await self._spawn()
            except UnavailableError:
                await self._free_slot()
                return
        async with self._returned:
            if self._closed:
                child.kill()
            else:
                self._idle.append(child)
            self._returned.notify()

    async def _free_slot(self) -> None:
        async with self._returned:
            self._slots -= 1
            self._returned.notify()

    async def _spawn(self) -> CompilerProcess:
        try:
            child = await CompilerProcess.start(self._start_frame)
        except UnavailableError as e:
            rate_limited.warning("sandbox", "constraint compiler start", "%s", e)
            raise
        self._children.add(child)
        self.stats["started"] += 1
        return child

    def _background(self, work, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _job(constraint: Constraint) -> Compile:
    """The Compile message of a constraint (a refusal naming its field if it cannot be one)."""
    value, field = constraint.value, constraint.field
    if isinstance(value, str):
        text, encoded = value, False
    else:
        try:  # a schema's dict or a list of choices, as JSON: ASCII, so lone surrogates survive as escapes
            text, encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=True), True
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidRequestError(field, f"is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if len(text) > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(field, f"is over {MAX_CONSTRAINT_BYTES} bytes: simplify it")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise InvalidRequestError(field, "holds text that is not valid Unicode (a lone surrogate)") from None
    return Compile(constraint.kind, text, encoded)


def _key(job: Compile) -> bytes:
    digest = hashlib.sha256(f"{job.kind}\0{int(job.encoded)}\0".encode())
    digest.update(job.text.encode())
    return digest.digest()
