"""SLO-aware admission: refuse at once a request that cannot meet its target (S-LoRA Appendix B,
early abort), instead of queuing it to fail later.

A request may carry a time-to-first-token target (`ttft_slo_s`, from its arrival) and a deadline
(the gRPC deadline, absolute). Its first token is predicted as

    wait    = max(0, ahead + 1 - free_slots) · service_s / slots
    ttft    = wait + prefill_s

`ahead` is how many queued requests go first (the queue says, by its own order), `slots` the
batch slots of the ready workers, `free_slots` those empty now, and `service_s` how long a request
holds a slot on average (its expected output times a decode step): with every slot busy, one
frees every service_s / slots seconds. A request is refused only when even this estimate, which
assumes a request's expected output is `output_fraction` of its budget, misses: RESOURCE_EXHAUSTED
for a TTFT target (a busy cluster; retrying later or elsewhere may work), DEADLINE_EXCEEDED for a
deadline (no first token before it), each with the numbers in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.errors import DeadlineExceededError, ResourceExhaustedError


@dataclass(frozen=True)
class ClusterEstimate:
    """What admission needs to know about the cluster now."""

    ahead: int  # queued requests that go before this one
    slots: int  # batch slots of the ready workers
    free_slots: int  # of which empty now
    service_s: float  # seconds a request holds a slot, on average
    prefill_s: float  # seconds of the step that prefills this request

    def ttft_s(self) -> float:
        waiting_for = max(0, self.ahead + 1 - self.free_slots)
        return waiting_for * self.service_s / max(1, self.slots) + self.prefill_s


def check_admission(
    estimate: ClusterEstimate, now: float, arrival: float, ttft_slo_s: float | None, deadline: float | None
) -> None:
    """Raise when the predicted first token misses the request's TTFT target or its deadline."""
    predicted = estimate.ttft_s()
    first_token_at = now + predicted
    if deadline is not None and first_token_at > deadline:
        raise DeadlineExceededError(
            f"refused early: the first token is predicted in {predicted:.3f} s ({estimate.ahead} requests ahead), "
            f"after the deadline ({max(0.0, deadline - now):.3f} s away)"
        )
    if ttft_slo_s is not None and first_token_at > arrival + ttft_slo_s:
        raise ResourceExhaustedError(
            f"refused early: the first token is predicted in {predicted:.3f} s ({estimate.ahead} requests ahead), "
            f"which misses the {ttft_slo_s:.3f} s time-to-first-token target; retry later"
        )
