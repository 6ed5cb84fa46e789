"""``python -m loragate.adapters.convert SRC OUT [--base DIR]``: the converter's child process."""

from loragate.adapters.convert.child_process import main

raise SystemExit(main())
