"""Who may ask what: API keys and the admin token (``auth``, ``admin_token``), cross-site
and client-address checks (``cross_site``), the headers every answer carries
(``security_headers``) and which engine routes pass through (``engine_allow_list``)."""
