"""``python -m loragate``: the Vi SDK local server's command line, served by ``gateway serve``.

The Vi SDK starts its server as ``python -m vi.deployment.local.server
--pretrained-model-name-or-path DIR --port P`` (with ``--run-id``, ``--secret-key``,
``--organization-id``, ``--model-name``, ``--host``); ``gateway serve`` takes each of those
flags, so this entry point is that command under the module name Vi users reach for. Every
other ``gateway serve`` option works here too.
"""

from __future__ import annotations

import sys

from loragate.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["serve"]
    sys.argv[0] = "python -m loragate"
    main()
