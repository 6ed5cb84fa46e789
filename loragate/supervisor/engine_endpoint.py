"""Where a booted engine listens and the key it takes: all a client of the engine needs."""

from __future__ import annotations

from dataclasses import dataclass

# Names no address: every client connects to the endpoint's socket. A request that took this
# URL without the socket fails to resolve "engine" instead of reaching some TCP port.
ENGINE_BASE_URL = "http://engine"


@dataclass(frozen=True)
class EngineEndpoint:
    """Where the engine listens: the Unix socket ``uds`` (see ``engine_socket``), reached with
    ``base_url`` for paths and the Host header, and ``api_key``, its per-boot key."""

    uds: str
    api_key: str
    base_url: str = ENGINE_BASE_URL

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}
