"""The GPU plan: what each engine needs of its GPUs as vLLM counts it (``need``), the rules and
lists read from the installed vLLM (``vllm_rules``), where each engine runs and with what share
of each GPU (``placement``), and that plan for a gateway's settings (``serve_plan``): what
``gateway plan`` prints and ``gateway serve`` boots with."""
