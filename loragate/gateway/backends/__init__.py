"""What answers requests behind the routes: each backend is a ``GatewayBackend`` (``base``).

``managed``: the gateway's own engines, one model or a catalog (one model is a catalog of one),
the HTTP face of the serving core (``loragate.serving``: each model's runtime, the catalog),
answering the core's refusals as OpenAI errors; ``upstream``: an existing OpenAI-compatible
server by URL; ``custom``: the public ``InferenceBackend`` interface
(``loragate.InferenceBackend``) that ``custom_adapter`` serves, with ``custom_parameters``.

Nothing is imported here: ``app`` imports the backend it builds (the managed one only when it
builds it).
"""
