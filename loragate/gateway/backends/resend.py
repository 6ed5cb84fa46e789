"""When a request the engine never answered may be sent to it again."""

from __future__ import annotations

import time

from loragate.gateway.proxy import UpstreamUnreachable


class ResendBudget:
    """Resend while the request's deadline lasts; a request that may itself have reached the
    engine just before it died only once, so a request that kills the engine cannot keep it in
    a crash loop (it costs at most one more restart, then its client gets the 503)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._resent_maybe_delivered = False

    def allows(self, failure: UpstreamUnreachable) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        if failure.maybe_delivered:
            if self._resent_maybe_delivered:
                return False
            self._resent_maybe_delivered = True
        return True
