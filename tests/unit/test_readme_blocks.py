"""Every code block in the README says how the suite runs it (or why it cannot)."""

from __future__ import annotations

import pytest

from loragate.settings import load_settings
from tests.readme_blocks import KINDS, blocks_of, readme_blocks


def test_every_readme_block_says_how_it_is_tested() -> None:
    blocks = readme_blocks()
    assert blocks
    unmarked = [block.id for block in blocks if block.kind not in KINDS]
    assert not unmarked, f"README blocks without <!-- readme-test: KIND -->: {unmarked}"
    skipped = [block.id for block in blocks if block.kind == "skip" and not block.why]
    assert not skipped, f"README blocks skipped without saying why: {skipped}"


@pytest.mark.parametrize("block", blocks_of("config"), ids=lambda block: block.id)
def test_readme_config_files_load(block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    suffix = {"toml": ".toml", "yaml": ".yaml"}[block.lang]
    path = tmp_path / f"config{suffix}"
    path.write_text(block.code)
    settings = load_settings(path)
    assert settings.model_fields_set
