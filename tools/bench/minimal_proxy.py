"""The least a Python proxy on uvicorn can do: the bench's "asgi-floor" reference.

A bare ASGI app that hands each request body to loragate's ``ProxyClient`` and relays the
answer: no routing, checks, auth, metrics or model names. Whatever it adds on top of the
engine is what uvicorn, asyncio and the upstream client cost on that machine, the floor for
any gateway built from them; the gap between it and loragate is loragate's own logic.

    LORAGATE_BENCH_UPSTREAM_KEY=KEY python -m tools.bench.minimal_proxy --port P --upstream URL \
        [--upstream-uds PATH]
"""

from __future__ import annotations

import argparse
import os

from starlette.types import Receive, Scope, Send

from loragate.gateway.proxy import ProxyClient


def build(upstream: str, api_key: str | None, uds: str | None = None) -> object:
    client = ProxyClient()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def nothing() -> None:
        pass

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        response = await client.forward(
            upstream + scope["path"],
            body,
            headers,
            stream=b'"stream":true' in body,
            rename=None,
            on_done=nothing,
            uds=uds,
        )
        await response(scope, receive, send)

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="http://host:port (no path)")
    parser.add_argument("--upstream-uds", help="connect to this Unix socket instead")
    args = parser.parse_args()
    import uvicorn

    app = build(
        args.upstream.rstrip("/"),
        os.environ.pop("LORAGATE_BENCH_UPSTREAM_KEY", None),
        args.upstream_uds,
    )
    uvicorn.run(
        app,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
