"""``gateway serve``'s HTTP server, owned whole: ``serve`` (life cycle), ``connection`` (one
client connection and its limits), ``exchange`` (one request and its answer), ``hot_routes``
(the inference POSTs answered without ASGI)."""
