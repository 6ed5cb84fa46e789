"""The gateway's HTTP routes, one module per group: thin handlers that parse, ask the backend
(or the gateway's own state), and shape the answer.

``inference`` (chat, completions, Vi; ``server.hot_routes`` answers the same endpoints on the
gateway server's own connections), ``passthrough`` (the engine's other routes, only those ``engine_allow_list``
names), ``admin`` (adapters), ``health``, ``metrics``, and the status page: ``status`` (what
it reads) and ``ui`` (its files).

Nothing is imported here: ``app`` imports the routers it mounts.
"""
