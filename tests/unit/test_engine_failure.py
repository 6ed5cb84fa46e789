"""Why a boot failed, read from the real engine's own log: whichever of its processes (worker,
engine core, API server) wrote the cause, never a wrapper that points elsewhere.

The logs in ``engine_logs/`` are vLLM 0.32 CPU's output, captured from ``gateway serve --model``
on the tiny demo base broken two ways (weights truncated to half, tokenizer files removed); paths
were shortened. ``tests/integration/test_user_model.py`` boots a third broken model for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loragate.supervisor.failure import ExitInfo, current_boot, exited_during_boot, root_cause

LOGS = Path(__file__).parent / "engine_logs"


def test_truncated_weights_name_the_workers_safetensors_error_not_the_wrappers(
    tmp_path: Path,
) -> None:
    lines = current_boot((LOGS / "truncated_weights.log").read_text().splitlines())
    assert root_cause(lines) == (
        "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: "
        "incomplete metadata, file not fully covered"
    )


def test_a_missing_tokenizer_keeps_the_message_lines_after_its_colon() -> None:
    lines = current_boot((LOGS / "no_tokenizer.log").read_text().splitlines())
    cause = root_cause(lines)
    assert cause is not None
    assert cause.startswith("ValueError: Couldn't instantiate the backend tokenizer from one of:")
    assert "sentencepiece or tiktoken installed" in cause
    assert "File " not in cause and "pid=" not in cause


def test_the_boot_failure_reason_is_the_root_cause_and_permanent(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text((LOGS / "truncated_weights.log").read_text())
    failure = exited_during_boot(ExitInfo(returncode=1, at=0.0), log)
    assert "SafetensorError: Error while deserializing header" in str(failure)
    assert "See stack trace" not in str(failure) and "WorkerProc" not in str(failure)
    assert failure.permanent


@pytest.mark.parametrize(
    "wrapper",
    [
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore': 1}",
        "Exception: WorkerProc initialization failed due to an exception in a background "
        "process. See stack trace for root cause.",
    ],
)
def test_a_wrapper_alone_is_still_reported(wrapper: str) -> None:
    assert root_cause(["Traceback (most recent call last):", '  File "x.py", line 1', wrapper]) == (
        wrapper
    )


def test_a_warning_that_mentions_an_error_is_not_the_cause() -> None:
    lines = [
        "(APIServer pid=1) WARNING 12-01 21:16:40 [system_utils.py:255] Found ulimit of 20000: "
        "this can cause fd limit errors like `OSError: [Errno 24] Too many open files`.",
        "(APIServer pid=1) ERROR 12-01 21:16:41 [core.py:9] Traceback (most recent call last):",
        '(APIServer pid=1) ERROR 12-01 21:16:41 [core.py:9]   File "x.py", line 1, in <module>',
        "(APIServer pid=1) ERROR 12-01 21:16:41 [core.py:9] ValueError: max_model_len too big",
        "(EngineCore pid=2) INFO 12-01 21:16:41 [core.py:10] shutting down:",
    ]
    assert root_cause(lines) == "ValueError: max_model_len too big"


async def test_a_config_that_does_not_parse_names_its_file(demo_dir: Path, tmp_path: Path) -> None:
    import shutil

    from loragate.base_model.resolve import BaseModelError
    from loragate.plan.engine_plan import plan_engine
    from loragate.settings import Settings

    model = tmp_path / "bad-config"
    shutil.copytree(demo_dir / "base", model)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    settings = Settings(cache_dir=tmp_path / "cache", model=str(model))
    with pytest.raises(BaseModelError, match=r"bad-config/config.json is not valid JSON"):
        await plan_engine(settings, tmp_path / "cache")
