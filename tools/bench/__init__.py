"""Side-by-side benchmarks: the same workload sent to the engine directly, through loragate,
and through nginx (the floor a reverse proxy can reach), interleaved request by request.

``python scripts/bench.py --help`` (or ``python -m tools.bench``) runs it. Modules:

- ``run``: the command line and the order of the measurements;
- ``load``: a lean keep-alive HTTP/1.1 load generator (closed loop, N connections);
- ``targets``: starting and stopping what is measured (``gateway serve``, nginx, engines);
- ``fake_engine``: an OpenAI server that answers at once, to price the proxy alone;
- ``engine_tap``: records the engine's port and per-boot key for the bench (0600 file);
- ``stats``: quantiles and the report.

None of this is imported by the gateway.
"""
