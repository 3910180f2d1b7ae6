"""The worker's core on its own: plain values in, effects out — no engine, no sockets, no threads.

Each test plays the loop: it hands the core decoded messages, fetch and build results, step outputs and
the time, answers its `Start`s, and reads the effects it returns.
"""

from __future__ import annotations

from loraserve.errors import ResourceExhaustedError, UnavailableError
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.wire import Assign, Cancel, Prefetch, StepTokens, Tokens
from loraserve.worker.core import EngineAnswers, WorkerCore
from loraserve.worker.effects import (
    Abort,
    AdapterRequested,
    Build,
    CopyIn,
    Ended,
    Fetch,
    Forget,
    GatewayGone,
    Now,
    Promote,
    Register,
    Report,
    Send,
    Start,
    Unsendable,
)
from loraserve.worker.engine import Cached
from loraserve.worker.fetch_threads import Fetched
from loraserve.worker.guide_builds import BuiltGuide
from loraserve.worker.request import FinishReason, Request
from loraserve.worker.step_results import StepOutput

GATEWAY = "tcp://127.0.0.1:7000"
OTHER_GATEWAY = "tcp://127.0.0.1:7001"
KEY = ("style", 1)
T0 = Now(wall=1000.0, mono=50.0)


def at(seconds: float) -> Now:
    return Now(T0.wall + seconds, T0.mono + seconds)


class FakeEngine:
    """The engine's answers about adapters, set by each test."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], str] = {}  # key -> sha256
        self.stale_in_use: set[tuple[str, int]] = set()
        self.standing: dict[tuple[str, int], str] = {}

    def cached(self, key, sha256=None) -> Cached:
        if key in self.stale_in_use:
            return Cached.STALE_IN_USE
        return Cached.YES if key in self.held and sha256 in (None, self.held[key]) else Cached.NO

    def holds(self, key, sha256=None) -> bool:
        return key in self.held and sha256 in (None, self.held[key])

    def answers(self) -> EngineAnswers:
        return EngineAnswers(self.cached, self.standing.get, self.holds)


def core_of(engine: FakeEngine | None = None, prefetch: bool = True) -> WorkerCore:
    engine = engine or FakeEngine()
    return WorkerCore("w1", engine.answers(), prefetch, report_interval_s=0.25, drain_timeout_s=5.0)


def spec(request_id: str = "r1", adapter: str | None = None, reply_to: str = GATEWAY, **fields) -> RequestSpec:
    sampling = fields.pop("sampling", SamplingParams(max_new_tokens=4))
    version = {"adapter_version": 1} if adapter else {}
    return RequestSpec(request_id, [1, 2, 3], sampling, reply_to, T0.wall, adapter=adapter, **version, **fields)


def start(core: WorkerCore, effects: list) -> None:
    """Play the engine: every `Start` succeeds."""
    for effect in effects:
        if isinstance(effect, Start):
            core.started(effect.spec.request_id, Request(effect.spec))


def ends(effects: list) -> dict[str, Tokens]:
    return {e.message.request_id: e.message for e in effects if isinstance(e, Send) and isinstance(e.message, Tokens)}


def test_an_assign_is_acknowledged_and_started_when_its_adapter_is_here():
    engine = FakeEngine()
    engine.held[KEY] = ""
    engine.standing[KEY] = "resident"
    core = core_of(engine)
    out = core.take(Assign(spec(adapter="style")), T0)
    assert [type(e) for e in out] == [Send, AdapterRequested, Start]
    assert out[0] == Send(GATEWAY, Tokens("r1", [], "w1"))
    assert out[1] == AdapterRequested("resident") and core.tracked["r1"].adapter_source == "hit"
    assert core.take(Assign(spec(adapter="style")), T0) == []  # a duplicate is dropped


def test_a_cold_adapter_is_fetched_once_and_its_requests_start_when_it_lands():
    core = core_of()
    first = core.take(Assign(spec("r1", adapter="style")), T0)
    assert first[1:] == [AdapterRequested("cold"), Fetch(KEY, False, {})]
    second = core.take(Assign(spec("r2", adapter="style")), T0)
    assert second[1:] == [AdapterRequested("loading")]  # joins the fetch under way
    assert core.report(T0)[0].waiting == ["r1", "r2"]
    out = core.fetched(Fetched(KEY, adapter=_Weights(), seconds=0.5, source="rows"), at(0.2))
    assert [type(e) for e in out] == [Register, Start, Start, CopyIn]
    assert out[-1] == CopyIn([KEY], demand=True)
    assert abs(core.tracked["r1"].fetch_s - 0.2) < 1e-9 and core.tracked["r1"].adapter_transport == "rows"
    assert core.report(T0)[0].waiting == []


def test_a_failed_fetch_ends_the_requests_parked_on_it():
    core = core_of()
    core.take(Assign(spec("r1", adapter="style")), T0)
    out = core.fetched(Fetched(KEY, error=UnavailableError("the store is gone")), T0)
    assert ends(out)["r1"].error_status == "UNAVAILABLE" and ends(out)["r1"].finished
    assert any(isinstance(e, Ended) for e in out) and core.report(T0)[0].finished == ["r1"]


def test_a_request_joining_a_prefetch_hurries_it():
    core = core_of()
    hint = core.take(Prefetch([KEY], [0.9]), T0)
    assert hint == [CopyIn([KEY], [0.9]), Fetch(KEY, True, None)]
    assert core.take(Assign(spec(adapter="style")), T0)[-1] == Promote(KEY)
    assert core_of(prefetch=False).take(Prefetch([KEY]), T0) == []


def test_weights_that_changed_under_running_requests_end_the_new_one():
    engine = FakeEngine()
    engine.stale_in_use.add(KEY)
    out = core_of(engine).take(Assign(spec(adapter="style")), T0)
    assert ends(out)["r1"].error_status == "UNAVAILABLE"


def test_structured_output_waits_for_its_matcher_then_goes_on():
    core = core_of()
    sampling = SamplingParams(max_new_tokens=4, grammar="start: /[a-z]+/")
    out = core.take(Assign(spec(sampling=sampling)), T0)
    assert out[1] == Build("r1", "start: /[a-z]+/", [])
    assert core.report(T0)[0].waiting == ["r1"]
    out = core.built(BuiltGuide("r1", matcher="matcher"), T0)
    assert out == [Start(core.tracked["r1"].spec, "matcher")]
    core.take(Assign(spec("r2", sampling=sampling)), T0)
    out = core.take(Cancel(["r2"], "client left"), T0)
    assert Forget("r2") in out and ends(out)["r2"].error_status == "CANCELLED"


def test_cancel_aborts_a_running_request_and_ends_a_waiting_one():
    core = core_of()
    start(core, core.take(Assign(spec("r1")), T0))
    core.take(Assign(spec("r2", adapter="style")), T0)
    out = core.take(Cancel(["r1", "r2", "unknown"], ""), T0)
    assert out[0] == Abort("r1") and ends(out)["r2"].error == "cancelled"
    assert core.report(T0)[0].waiting == []


def test_a_passed_deadline_aborts_once():
    core = core_of()
    start(core, core.take(Assign(spec(deadline=T0.wall + 1)), T0))
    assert core.expire(at(0.5)) == []
    assert core.expire(at(1.0)) == [Abort("r1", "the deadline passed")]
    assert core.expire(at(2.0)) == []
    out = core.deliver([StepOutput("r1", [], True, FinishReason.ERROR, "the deadline passed")], at(2.0))
    assert ends(out)["r1"].error_status == "DEADLINE_EXCEEDED"


def test_a_step_sends_one_step_tokens_per_gateway_and_a_tokens_per_end():
    core = core_of()
    for request_id, gateway in (("a", GATEWAY), ("b", OTHER_GATEWAY), ("c", GATEWAY)):
        start(core, core.take(Assign(spec(request_id, reply_to=gateway)), T0))
    out = core.deliver(
        [StepOutput("a", [7], False), StepOutput("b", [8], True, FinishReason.LENGTH), StepOutput("c", [9], False)],
        at(1),
    )
    steps = [e for e in out if isinstance(e, Send) and isinstance(e.message, StepTokens)]
    assert [(s.address, s.message.request_ids, s.going_on) for s in steps] == [(GATEWAY, ["a", "c"], ["a", "c"])]
    assert ends(out)["b"].token_ids == [8] and ends(out)["b"].finish_reason == "length"
    assert set(core.tracked) == {"a", "c"}


def test_a_gateway_gone_hands_its_requests_back_and_unsendable_tokens_abort_theirs():
    core = core_of()
    start(core, core.take(Assign(spec("a")), T0))
    core.take(Assign(spec("b", adapter="style")), T0)
    start(core, core.take(Assign(spec("c", reply_to=OTHER_GATEWAY)), T0))
    out = core.take(GatewayGone(GATEWAY), T0)
    assert Abort("a") in out and Abort("b") not in out
    assert {rid: (t.error_status, t.retry) for rid, t in ends(out).items()} == {
        "a": ("UNAVAILABLE", True),
        "b": ("UNAVAILABLE", True),
    }
    assert core.take(Unsendable(OTHER_GATEWAY, ["c", "gone"], "full"), T0) == [Abort("c")]


def test_a_start_the_engine_refuses_ends_the_request():
    core = core_of()
    core.take(Assign(spec()), T0)
    out = core.start_failed("r1", ResourceExhaustedError("the prompt does not fit"), T0)
    assert ends(out)["r1"].error_status == "RESOURCE_EXHAUSTED"


def test_reports_when_idle_and_draining_hands_back_what_is_left():
    core = core_of()
    assert core.report(T0) == [Report(False, False, [], [])]
    assert core.idle(at(0.1)) == [] and len(core.idle(at(0.3))) == 1
    assert core.become_ready(at(0.3))[0].ready
    start(core, core.take(Assign(spec("r1")), T0))
    assert core.drain(at(1))[0].draining and core.going(at(5.9))
    refused = core.take(Assign(spec("r2")), at(1))  # sent before the scheduler saw the draining report
    assert ends(refused)["r2"].retry
    assert not core.going(at(6.1))
    out = core.stop(at(6.1))
    assert ends(out)["r1"].retry and out[-1].fatal == "drained on SIGTERM"
    assert out[-1].finished == ["r2", "r1"]


def test_stop_on_an_error_says_so():
    core = core_of()
    core.take(Assign(spec("r1")), T0)
    out = core.stop(T0, RuntimeError("boom"))
    assert ends(out)["r1"].error == "worker w1 failed: boom" and out[-1].fatal == "boom"


class _Weights:
    """Stands for a fetched LoraAdapter: the core reads only its sha256."""

    sha256 = ""
