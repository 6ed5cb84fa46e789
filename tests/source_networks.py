"""Letting adapter sources reach a test's own servers on 127.0.0.1, for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from loragate.fetching.source_networks import allow_source_networks, allowed_source_networks
from loragate.http.addresses import AllowedNetworks


@contextlib.contextmanager
def sources_may_reach(*entries: str) -> Iterator[None]:
    """``allowed_source_networks`` set to ``entries`` inside the block, as it was after."""
    before = allowed_source_networks()
    allow_source_networks(AllowedNetworks.parse(entries))
    try:
        yield
    finally:
        allow_source_networks(before)
