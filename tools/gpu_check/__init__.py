"""The acceptance run on one GPU (``scripts/gpu_check.sh``): a budgeted sequence of checks that
need a GPU, with vLLM and the models already on the machine.

- ``budget``: the overall time budget, steps skipped with a reason, the report (runs in the
  suite);
- ``vllm_log``: vLLM's log lines about memory, read back, and ``gateway plan`` held against
  them (runs in the suite, on fixture lines);
- ``steps``: the steps themselves, on the GPU;
- ``__main__``: ``python -m tools.gpu_check [--budget S] [--report FILE]``.

docs/gpu.md "The acceptance run" says what each step checks.
"""
