"""What a preflight check reports: one problem, one sentence saying what to do, and the error
that lists them all when the engine cannot start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CheckName = Literal["engine", "accelerator", "parallel", "memory", "port", "cache_dir"]


@dataclass(frozen=True)
class PreflightProblem:
    check: CheckName
    message: str

    def __str__(self) -> str:
        return self.message


class PreflightError(RuntimeError):
    """The engine cannot start; ``problems`` says why, one sentence each."""

    def __init__(self, problems: list[PreflightProblem]) -> None:
        self.problems = list(problems)
        lines = "".join(f"\n  - {problem.message}" for problem in self.problems)
        super().__init__(f"cannot start:{lines}")
