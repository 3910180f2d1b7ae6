"""Per-tenant fairness: the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24, Algorithm 2).

Each tenant has a counter of the service it received, in weighted tokens: `input_weight` per prompt
token and `output_weight` per output token (output tokens cost more: one step each). The queue
serves the backlogged tenant with the smallest counter first, so a tenant that floods only raises
its own counter and waits behind the others; a tenant that sends little is served at once.

A tenant that becomes backlogged again has its counter *lifted* to the smallest counter among
the backlogged tenants (or, when none is, to the counter of the last tenant that stopped being
backlogged): being idle earns no credit to spend later in a burst that would starve the others.

The scheduler does not see each generated token, so a request is charged when it is placed, for
its prompt and its token budget (`max_new_tokens`), i.e. VTC with the output length predicted by
its upper bound; requests that stop early are over-charged by the same rule for every tenant.

VTC orders the queue; `flooder_cap` bounds the batch slots of a tenant that floods the others (one
sending at least twice as many requests per second as any other active tenant: `TenantRates`), so
their steps stay short.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable

from loraserve.errors import InvalidConfigError


class VirtualTokenCounter:
    """VTC counters per tenant; `activate`/`deactivate` as a tenant's backlog starts and empties."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, max_tenants: int = 4096):
        if input_weight < 0 or output_weight < 0 or max_tenants < 1:
            raise InvalidConfigError("VTC weights must be >= 0 and max_tenants >= 1")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.max_tenants = max_tenants
        self._counters: OrderedDict[str, float] = OrderedDict()  # least recently active first
        self._backlogged: set[str] = set()
        self._last_left = 0.0

    def known_tenants(self) -> int:
        return len(self._counters)

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def activate(self, tenant: str) -> None:
        """`tenant` has a request queued and had none: lift its counter (no credit for idling)."""
        if tenant in self._backlogged:
            return
        lift = min((self._counters[t] for t in self._backlogged), default=self._last_left)
        self._counters[tenant] = max(self._counters.get(tenant, 0.0), lift)
        self._counters.move_to_end(tenant)
        self._backlogged.add(tenant)
        self._forget_idle()

    def deactivate(self, tenant: str) -> None:
        """`tenant` has nothing queued any more."""
        if tenant in self._backlogged:
            self._backlogged.discard(tenant)
            self._last_left = self._counters.get(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Service given to `tenant`: a request of its was placed."""
        cost = self.input_weight * prompt_tokens + self.output_weight * output_tokens
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost
        self._counters.move_to_end(tenant)

    def _forget_idle(self) -> None:
        """Bound memory (tenant ids may come from clients): drop the longest idle tenants. A
        forgotten tenant's counter would be lifted on its return anyway."""
        for tenant in list(self._counters):
            if len(self._counters) <= self.max_tenants:
                break
            if tenant not in self._backlogged:
                del self._counters[tenant]


class TenantRates:
    """Each tenant's arrival rate, requests per second, as an exponentially weighted average (half-life
    `half_life_s`); at most `max_tenants` (the least recently active go first)."""

    def __init__(self, half_life_s: float = 5.0, max_tenants: int = 4096):
        if half_life_s <= 0 or max_tenants < 1:
            raise InvalidConfigError("half_life_s must be > 0 and max_tenants >= 1")
        self.tau = half_life_s / math.log(2)
        self.max_tenants = max_tenants
        self._rates: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (rate, at)

    def arrived(self, tenant: str, now: float) -> None:
        self._rates[tenant] = (self.rate(tenant, now) + 1.0 / self.tau, now)
        self._rates.move_to_end(tenant)
        while len(self._rates) > self.max_tenants:
            self._rates.popitem(last=False)

    def rate(self, tenant: str, now: float) -> float:
        rate, at = self._rates.get(tenant, (0.0, now))
        return rate * math.exp(-max(0.0, now - at) / self.tau)


def flooder_cap(
    in_flight: Counter[str],
    queued: dict[str, int],
    slots: int,
    share: float,
    rate: Callable[[str], float] | None = None,
    flood_ratio: float = 2.0,
) -> tuple[str, int] | None:
    """(the flooding tenant, the batch slots it may hold), or None when no tenant floods the others.

    VTC orders the queue, but a tenant that fills every batch slot still makes the others wait for
    a slot to free, and slows every step they join (a step's time grows with its batch). So while
    others are active (running or queued), the tenant with the largest backlog may hold at most
    `share` of an equal split of the slots; the rest stays free for the tenants that send less —
    provided it sends at least `flood_ratio` times as many requests as any other active tenant
    (`rate(tenant)`, requests per second; None: not asked). Tenants that send alike are never capped,
    however many there are and however long their backlogs: a cap on one of equals would only grow
    its backlog, and keep it the largest.
    """
    active = {t for t, n in in_flight.items() if n > 0} | {t for t, n in queued.items() if n > 0}
    if len(active) < 2 or not queued:
        return None
    flooder = max(queued, key=lambda t: (queued[t], t))
    if rate is not None and rate(flooder) < flood_ratio * max(rate(t) for t in active if t != flooder):
        return None
    return flooder, max(1, math.floor(share * slots / len(active)))
