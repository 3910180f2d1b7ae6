"""The worker's reports name its resident adapters when the set changed, and every RESIDENT_RESEND_S in
any case (a scheduler that restarted learns them): an order that changes with every step that uses
an adapter is not news to the scheduler, which reads only the set."""

from __future__ import annotations

import time

from emulated import emulated_engine, fixed_profile

from loraserve.wire import RESIDENT_RESEND_S, decode, encode
from loraserve.worker import reporter as reporter_module
from loraserve.worker.reporter import Reporter
from loraserve.worker.sampling import SamplingParams


def _run(engine, adapter: str) -> None:
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), adapter)
    while engine.has_unfinished():
        engine.step()


def _resident(reporter: Reporter) -> set | None:
    """The resident adapters the next report names, as the scheduler decodes them (None: unchanged)."""
    named = decode(encode(reporter.report(True, False, []))).resident
    return None if named is None else {tuple(k) for k in named}


def test_reports_name_the_resident_set_when_it_changed_and_every_few_seconds(tmp_path, monkeypatch):
    engine = emulated_engine(fixed_profile(tmp_path / "profile.json"))
    reporter = Reporter(engine, "w1", "i1")
    assert _resident(reporter) == set()  # the first report names it, even empty
    assert _resident(reporter) is None
    _run(engine, "upper")
    upper = engine.registry.latest("upper")
    assert _resident(reporter) == {upper}
    assert _resident(reporter) is None
    _run(engine, "rot13")
    rot13 = engine.registry.latest("rot13")
    assert _resident(reporter) == {upper, rot13}
    _run(engine, "upper")  # the order changed, the set did not
    assert engine.pool.pages.resident_adapters() == [rot13, upper]
    assert _resident(reporter) is None
    assert reporter.resident_count == 2  # what the metrics endpoint shows, whether the report named them or not
    later = time.monotonic() + RESIDENT_RESEND_S + 0.1
    monkeypatch.setattr(reporter_module.time, "monotonic", lambda: later)
    assert _resident(reporter) == {upper, rot13}  # resent: a restarted scheduler learns it
    assert _resident(reporter) is None
