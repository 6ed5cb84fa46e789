"""``python -m tools.gpu_check``: the acceptance run on this machine's GPU, within a budget.

Exit status: 0 when no step failed or ran out of time (skipped steps say why), 1 when one
did, 2 when it cannot run here at all (no GPU, or no CUDA build of vLLM: it installs nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tools.gpu_check.budget import (
    Budget,
    StepResult,
    exit_code,
    json_report,
    result_text,
    run_steps,
    summary,
)
from tools.gpu_check.steps import Checks, needs_cuda_vllm

DEFAULT_BUDGET_S = 480.0  # 8 minutes on one GPU


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__)
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help=f"the whole run's time (default {DEFAULT_BUDGET_S:.0f})")  # fmt: skip
    parser.add_argument("--report", type=Path, metavar="FILE", help="also write the report as JSON")
    options = parser.parse_args(argv)

    budget = Budget(options.budget)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        checks = Checks(Path(work))
        for reason in (checks.needs_gpu(), needs_cuda_vllm()):
            if reason is not None:
                print(f"gpu_check: skipped: {reason}", file=sys.stderr)
                return 2
        print(f"gpu_check: {len(checks.steps())} steps within {options.budget:.0f} s", flush=True)

        def show(result: StepResult) -> None:
            print(result_text(result), flush=True)

        try:
            results = run_steps(checks.steps(), budget, on_result=show)
        finally:
            checks.close()
    print(summary(results, budget))
    if options.report is not None:
        options.report.write_text(json_report(results, budget) + "\n")
        print(f"report: {options.report}")
    return exit_code(results)


if __name__ == "__main__":
    raise SystemExit(main())
