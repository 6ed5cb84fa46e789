"""The mark that makes a settings field a `gateway serve` option too.

``loragate/cli_options.py`` reads the mark back from each field's ``json_schema_extra``, so a
setting's type, default, constraints and description are written once, in its field group.
"""

from __future__ import annotations

from typing import Any


def serve_option(
    *flags: str, envvar: str | None = None, repeatable: bool = False
) -> dict[str, Any]:
    """Marks a field as a `gateway serve` option (``cli_options`` builds it): its flags (the
    field's own --kebab-name when none are given), its help the field's description.
    ``repeatable``: a one-value field whose option may be given several times (the field's
    validator reads the list; one value passes as it is)."""
    return {"cli": list(flags), "cli_envvar": envvar, "cli_repeatable": repeatable}
