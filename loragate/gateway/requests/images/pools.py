"""The small thread pools image work runs in: never on the event loop, and never in the
default pool the supervisor needs for its own work. One for decoding, one for DNS."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

PoolKind = Literal["media", "dns"]
_T = TypeVar("_T")

_POOL_SIZES: dict[PoolKind, int] = {"media": min(4, os.cpu_count() or 1), "dns": 4}
_pools: dict[PoolKind, ThreadPoolExecutor] = {}


def pool(kind: PoolKind) -> ThreadPoolExecutor:
    """The pool for ``kind``, started on first use (threads named ``loragate-<kind>``)."""
    found = _pools.get(kind)
    if found is None:
        found = _pools[kind] = ThreadPoolExecutor(
            max_workers=_POOL_SIZES[kind], thread_name_prefix=f"loragate-{kind}"
        )
    return found


async def in_pool(kind: PoolKind, fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn`` in the bounded pool for ``kind``: image work never fills the default pool."""
    return await asyncio.get_running_loop().run_in_executor(pool(kind), fn, *args)
