"""The serving core, below the HTTP layer (nothing here imports the gateway, Starlette or
FastAPI): each base model's runtime (``model``: its plan, engine, adapters, leases, requests
and residency), the catalog of a gateway's models (``catalog``: one model is a catalog of one),
the decisions it applies as plain functions (``eviction``, ``room``, ``sleep``,
``adapter_search``), and the refusals it raises in its own words (``errors``)."""
