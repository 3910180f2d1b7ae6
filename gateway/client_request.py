"""One client request of several generations, as the scheduler sees it: one key, one token cost.

An HTTP body asks for several generations (its prompts × n, or best_of's candidates); the generation
core runs each on its own. The scheduler counts a worker's batch slots per client request
(`SubmitRequest.request_key`), and charges the tenant's token quota once for all its generations
(`request_cost`: the sum of prompt + max_new_tokens over them), so that the request is admitted or
refused whole. That sum is known only once every generation has been validated and tokenized: each
reports its own cost here (`cost_of_all`) and waits until all have, then all submit with the total.
A generation that ends before it reported (refused at admission or validation, or cancelled) calls
`abandon` with its failure: those waiting fail with the same error (the request fails whole, and the
edge answers with whichever failure it sees first), or with AbandonedError (CANCELLED) when it was
not a LoraserveError (a cancellation).
"""

from __future__ import annotations

import asyncio

from loraserve.errors import LoraserveError


class AbandonedError(LoraserveError):
    """Another generation of the same client request failed before it was submitted."""

    status = "CANCELLED"


class ClientRequest:
    """The generations of one client request: its key and their total token cost (module docstring)."""

    def __init__(self, key: str, generations: int):
        if generations < 1:
            raise ValueError(f"a client request has at least one generation, got {generations}")
        self.key = key  # the gateway's id of the request (the tenant prefix is added where it is submitted)
        self._missing = generations  # generations whose cost is not known yet
        self._cost = 0
        self._total: asyncio.Future[int] | None = None

    async def cost_of_all(self, cost: int) -> int:
        """Report one generation's `cost` (prompt + max_new_tokens); the sum over every generation, once
        all have reported. Raises AbandonedError if one ended first."""
        total = self._future()
        if not total.done():
            self._cost += cost
            self._missing -= 1
            if self._missing == 0:
                total.set_result(self._cost)
        return await asyncio.shield(total)

    def abandon(self, failure: BaseException | None = None) -> None:
        """A generation ended before it reported its cost (with `failure`): the others stop waiting, and
        raise `failure` when it is a LoraserveError, else AbandonedError."""
        total = self._future()
        if not total.done():
            if not isinstance(failure, LoraserveError):
                failure = AbandonedError("another generation of this request failed before it was submitted")
            total.set_exception(failure)
            total.exception()  # retrieved: nobody may be left to wait for it

    def _future(self) -> asyncio.Future[int]:
        if self._total is None:
            self._total = asyncio.get_running_loop().create_future()
        return self._total
