"""A request whose attempts keep losing their worker before a new token is not resubmitted.

Over a real token sink (the harness of test_gateway_failover.py): a worker acknowledges each attempt and
is then lost under it. Two such losses in a row with no token between them end the request INTERNAL
(not UNAVAILABLE, which clients retry), saying it was not resubmitted and why; a loss after progress, a
migration (the scheduler moving the request off a worker that is fine) and a loss before any worker took
the attempt do not count.
"""

from __future__ import annotations

import asyncio

import pytest
from test_gateway_failover import _collect, with_harness

from loraserve.gateway.failover import FailoverConfig, NotResubmittedError

LOST = {"finished": True, "error_status": "UNAVAILABLE", "retry": True}


async def _attempt(harness, attempt_id: str, *tokens: int, acknowledged: bool = True, **loss) -> None:
    """Wait for `attempt_id`'s submission; a worker takes it (or not), streams `tokens`, and is lost."""
    while not harness.submits or harness.submits[-1][0] != attempt_id:
        await asyncio.sleep(0.01)
    if acknowledged:
        harness.push_tokens(attempt_id, [], worker_id="w0")
    if tokens:
        harness.push_tokens(attempt_id, list(tokens), worker_id="w0")
    harness.push_tokens(attempt_id, [], **{**LOST, "error": f"worker w0 stopped responding ({attempt_id})", **loss})


@with_harness
async def test_two_losses_in_a_row_without_a_token_end_the_request_internal(harness):
    collecting = asyncio.create_task(_collect(harness.stream()))
    await _attempt(harness, "r", 5, 6)  # progress: a loss that does not count
    await _attempt(harness, "r.1")
    await _attempt(harness, "r.2")
    with pytest.raises(NotResubmittedError) as info:
        await asyncio.wait_for(collecting, 5)
    assert info.value.status == "INTERNAL"
    message = str(info.value)
    assert "not resubmitted" in message and "2 attempts in a row" in message and "(r.2)" in message, message
    assert [attempt for attempt, _ in harness.submits] == ["r", "r.1", "r.2"], "no attempt after the second loss"
    assert harness.cancels == ["r", "r.1", "r.2"]


def test_progress_migrations_and_unplaced_losses_do_not_count():
    with_harness(_uncounted)(FailoverConfig(max_failovers=10, inactivity_timeout_s=5.0))


async def _uncounted(harness) -> None:
    stream = harness.stream()
    collecting = asyncio.create_task(_collect(stream))
    await _attempt(harness, "r")  # counts: 1
    await _attempt(harness, "r.1", 7)  # a token: back to 0
    await _attempt(harness, "r.2", moved=True)  # a migration
    await _attempt(harness, "r.3", acknowledged=False)  # queued when the scheduler lost its last worker
    await _attempt(harness, "r.4")  # counts: 1
    while harness.submits[-1][0] != "r.5":
        await asyncio.sleep(0.01)
    harness.push_tokens("r.5", [8], worker_id="w1", finished=True, finish_reason="length")
    messages = await asyncio.wait_for(collecting, 5)
    assert [t for m in messages for t in m.token_ids] == [7, 8]
    assert stream.failovers == 5 and stream.losses_without_progress == 1


def test_the_limit_is_a_setting_and_zero_turns_it_off():
    config = FailoverConfig(max_failovers=4, inactivity_timeout_s=5.0, max_losses_without_progress=0)
    with_harness(_without_limit)(config)
    with pytest.raises(Exception, match="max_losses_without_progress"):
        FailoverConfig(max_losses_without_progress=-1)


async def _without_limit(harness) -> None:
    collecting = asyncio.create_task(_collect(harness.stream()))
    for attempt in ("r", "r.1", "r.2", "r.3", "r.4"):
        await _attempt(harness, attempt)
    with pytest.raises(Exception, match="lost with its worker 5 times") as info:
        await asyncio.wait_for(collecting, 5)
    assert info.value.status == "UNAVAILABLE", "without the limit, only max_failovers ends it"
