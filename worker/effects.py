"""The plain values between the worker's core (`worker/core.py`) and the loop around it (`worker/service.py`).

In: `Now` (the clock, read by the loop), and what the I/O thread tells besides the scheduler's messages
(`Unsendable`, `GatewayGone`). Out: the core's effects, each one thing for the loop to do, in order:

| effect | the loop |
|---|---|
| `Send` | pushes a TOKENS / STEP_TOKENS to a gateway (I/O thread) |
| `Report` | builds the `WorkerReport` (`reporter.py`) and sends it to the scheduler |
| `Start` | queues the request in the engine (`Engine.add_spec`), telling the core how that went |
| `Abort` | aborts a request in the engine (its pages are freed at the next step) |
| `Fetch` / `Promote` | queues an adapter fetch from the store / hurries a queued prefetch (fetch threads) |
| `Build` / `Forget` | starts / drops a structured-output matcher build (`guide_builds.py`) |
| `Register` | registers a fetched adapter with the engine |
| `CopyIn` | copies adapters into the pool in the background (`EngineAdapters.prefetch`) |
| `AdapterRequested` | counts how a request's adapter stood (`metrics.ADAPTER_REQUESTS`) |
| `Ended` | records an ended request's trace spans |
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraserve.request_spec import RequestSpec
from loraserve.wire import AdapterKey, StepTokens, Tokens

if TYPE_CHECKING:
    from loraserve.worker.adapters import LoraAdapter
    from loraserve.worker.tracked import Tracked


@dataclass(frozen=True)
class Now:
    wall: float  # time.time(): deadlines and the gateway's timings
    mono: float  # time.monotonic(): report and drain intervals, the engine's timestamps

    @classmethod
    def read(cls) -> Now:
        """The clock now (the loop reads it and passes it in; the core never does)."""
        return cls(time.time(), time.monotonic())


@dataclass(frozen=True)
class Unsendable:
    """Tokens for these requests could not be handed to their gateway (gone, stuck or unreachable)."""

    address: str
    request_ids: Sequence[str]
    error: str


@dataclass(frozen=True)
class GatewayGone:
    """The connection to the gateway at `address` dropped."""

    address: str


@dataclass(frozen=True)
class Send:
    address: str
    message: Tokens | StepTokens
    going_on: Sequence[str] = ()  # requests to abort if the gateway cannot take it (told back as Unsendable)


@dataclass(frozen=True)
class Report:
    ready: bool
    draining: bool
    waiting: list[str]  # requests waiting for their adapter's fetch or their matcher's build
    finished: list[str]  # requests ended since the last report
    fatal: str | None = None


@dataclass(frozen=True)
class Start:
    spec: RequestSpec
    guide: Any = None  # its llguidance matcher, with a grammar


@dataclass(frozen=True)
class Abort:
    request_id: str
    error: str | None = None  # None: cancelled


@dataclass(frozen=True)
class Fetch:
    key: AdapterKey
    for_prefetch: bool
    trace: dict[str, str] | None


@dataclass(frozen=True)
class Promote:
    key: AdapterKey


@dataclass(frozen=True)
class Build:
    request_id: str
    grammar: str
    output_ids: list[int]


@dataclass(frozen=True)
class Forget:
    request_id: str


@dataclass(frozen=True)
class Register:
    key: AdapterKey
    adapter: LoraAdapter


@dataclass(frozen=True)
class CopyIn:
    keys: list[AdapterKey]
    scores: Sequence[float] | None = None  # the scheduler's predicted likelihoods, remembered per adapter
    demand: bool = False  # fetched for requests waiting on it: copied in even with prefetch off


@dataclass(frozen=True)
class AdapterRequested:
    found: str  # resident | ready | loading | cold (`metrics.ADAPTER_REQUESTS`)


@dataclass(frozen=True)
class Ended:
    tracked: Tracked
    timings: dict[str, float]
    error_status: str | None


Effect = Send | Report | Start | Abort | Fetch | Promote | Build | Forget | Register | CopyIn | AdapterRequested | Ended
