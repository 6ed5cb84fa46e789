"""The crash-loop breaker: boot failures counted within a sliding window, so that an engine
that keeps dying ends in `failed` instead of restarting forever."""

from __future__ import annotations

from collections import deque


class CrashLoopBreaker:
    """When the engine failed recently. A run that stayed ready for ``stable_after`` seconds
    clears the count: failures hours apart are no crash loop."""

    def __init__(self) -> None:
        self._failures: deque[float] = deque()

    def __len__(self) -> int:
        return len(self._failures)

    def clear(self) -> None:
        self._failures.clear()

    def record(
        self, now: float, ready_since: float | None, *, stable_after: float, window: float
    ) -> int:
        """Count a failure at ``now`` (monotonic); returns how many fall within ``window``."""
        if ready_since is not None and now - ready_since >= stable_after:
            self._failures.clear()  # it ran fine for a while: this is no crash loop
        self._failures.append(now)
        while self._failures and now - self._failures[0] > window:
            self._failures.popleft()
        return len(self._failures)
