"""The gateway's one HTTP/1.1 client to the engine (or any upstream), without a client library.

``wire`` writes requests, ``connection`` holds the one protocol class that reads every answer
(httptools' C parser), ``pool`` keeps connections alive for the relayed requests,
``oneshot`` sends one request on a fresh connection for probes, scrapes and admin calls, and
``sse`` finds where a relayed stream's events end.
httpx stays for the outside world (downloads, hubs). A leaf: nothing else of loragate is
imported here.
"""
