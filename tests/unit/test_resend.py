"""A request the engine never answered is resent while its deadline lasts, a possible poison
request only once."""

from __future__ import annotations

import time

from loragate.gateway.proxy import ResendBudget, UpstreamUnreachable


def unreachable(maybe_delivered: bool) -> UpstreamUnreachable:
    failure = UpstreamUnreachable(503, "the engine is not reachable; retry shortly")
    failure.maybe_delivered = maybe_delivered
    return failure


def test_a_request_that_never_reached_the_engine_is_resent_until_its_deadline() -> None:
    budget = ResendBudget(time.monotonic() + 60)
    assert all(budget.allows(unreachable(False)) for _ in range(20))
    assert not ResendBudget(time.monotonic() - 1).allows(unreachable(False))


def test_a_request_that_may_have_killed_the_engine_is_resent_only_once() -> None:
    budget = ResendBudget(time.monotonic() + 60)
    assert budget.allows(unreachable(True))
    assert budget.allows(unreachable(False))  # the restart is not up yet: still fine
    assert not budget.allows(unreachable(True))
