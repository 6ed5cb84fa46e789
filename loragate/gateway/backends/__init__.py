"""What answers requests behind the routes: each backend is a ``GatewayBackend`` (``base``).

``supervised``: the bundled one, a supervised vLLM engine with managed adapters (``engine_plan``
decides what it boots, ``engine_metrics`` and ``engine_names`` turn engine ids back into
public names, ``resend`` says when a request may go to a restarted engine again);
``upstream``: an existing OpenAI-compatible server by URL; ``custom``: the public
``InferenceBackend`` interface (``loragate.InferenceBackend``) that ``custom_adapter`` serves,
with ``custom_events`` and ``custom_parameters``.

Nothing is imported here: ``app`` imports the backend it builds (the supervised one only when
it builds it).
"""
