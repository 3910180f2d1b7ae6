"""Token quotas for a client request of several generations (`scheduler/quotas.py`, `group`): admitted or
refused whole, charged once for the sum of its generations' costs, refunded whole when one of them is
refused after the charge, and a request larger than the whole quota refused with no retry hint."""

from __future__ import annotations

import pytest

from loraserve.errors import ResourceExhaustedError
from loraserve.scheduler.quotas import QuotaExceededError, TokenQuotas


def test_a_list_that_fits_is_charged_once_for_all_its_generations():
    quotas = TokenQuotas()
    group = ("t/cmpl-1", 90)  # three generations of 30 tokens
    assert quotas.charge("t", 100, 30, 0.0, group=group) == 90  # the first charges the whole request
    assert quotas.charge("t", 100, 30, 0.0, group=group) == 0  # its siblings: admitted, nothing more
    assert quotas.charge("t", 100, 30, 0.0, group=group) == 0
    quotas.charge("t", 100, 10, 0.0)  # 90 + 10: the whole bucket
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 100, 1, 0.0)


def test_a_list_that_can_never_fit_is_refused_whole_with_no_hint_and_takes_nothing():
    quotas = TokenQuotas()
    group = ("t/cmpl-2", 120)  # four generations of 30 against 100 a minute: each alone would fit
    for _ in range(4):
        with pytest.raises(QuotaExceededError) as info:
            quotas.charge("t", 100, 30, 0.0, group=group)
        assert info.value.retry_after_s is None, "a retry could never succeed"
        assert "120 tokens" in str(info.value) and "never" in str(info.value) and "fewer prompts" in str(info.value)
    assert quotas.charge("t", 100, 100, 0.0) == 100  # nothing was taken: the whole quota is left


def test_a_list_refused_for_now_shares_its_hint_and_is_charged_whole_later():
    quotas = TokenQuotas()
    quotas.charge("t", 60, 50, 0.0)  # 10 left; one a second comes back
    group = ("t/cmpl-3", 40)
    with pytest.raises(QuotaExceededError) as first:
        quotas.charge("t", 60, 20, 0.0, group=group)
    assert first.value.retry_after_s == pytest.approx(30.0)
    with pytest.raises(QuotaExceededError) as sibling:
        quotas.charge("t", 60, 20, 10.0, group=group)  # the same refusal, its hint shortened by the time since
    assert sibling.value.retry_after_s == pytest.approx(20.0)
    assert quotas.charge("t", 60, 20, 31.0, group=("t/cmpl-4", 40)) == 40  # the client's retry: a new request


def test_a_sibling_refused_by_the_queue_gives_the_whole_charge_back_and_the_rest_follow_it():
    quotas = TokenQuotas()
    group = ("t/cmpl-5", 80)
    charged = quotas.charge("t", 100, 40, 0.0, group=group)
    assert quotas.charge("t", 100, 40, 0.0, group=group) == 0
    quotas.refund("t", 100, 0, 0.0, group=group, refusal=ResourceExhaustedError("the scheduler queue is full"))
    assert charged == 80
    with pytest.raises(ResourceExhaustedError, match="queue is full"):  # a later sibling: refused too
        quotas.charge("t", 100, 40, 0.0, group=group)
    assert quotas.charge("t", 100, 100, 0.0) == 100  # the request's 80 came back


def test_outcomes_are_remembered_a_short_while_and_in_bounded_number():
    from loraserve.scheduler.quotas import GROUP_MEMORY_S, MAX_GROUPS

    quotas = TokenQuotas()
    quotas.charge("t", 10**6, 1, 0.0, group=("t/old", 10))
    assert quotas.charge("t", 10**6, 1, GROUP_MEMORY_S + 1, group=("t/old", 10)) == 10  # forgotten: charged anew
    for i in range(MAX_GROUPS + 10):
        quotas.charge("t", 10**9, 1, 100.0, group=(f"t/{i}", 2))
    assert quotas.requests() == MAX_GROUPS
    assert quotas.charge("t", 0, 10**6, 0.0, group=("t/free", 10**6)) == 0  # unlimited: nothing kept


def test_a_submit_without_a_group_is_charged_alone_as_before():
    quotas = TokenQuotas()
    assert quotas.charge("t", 100, 60, 0.0) == 60
    assert quotas.charge("t", 100, 40, 0.0, group=("t/k", 0)) == 40  # a key without a cost: alone
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 100, 1, 0.0)
