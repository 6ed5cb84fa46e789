"""``python -m loragate.adapters.intake.convert SRC OUT [--base DIR]``: the converter's child process."""

from loragate.adapters.intake.convert.child_process import main

raise SystemExit(main())
