"""What a cache dir holds (``contents``: adapter versions, base models, GGUF conversions, the
demos, logs, leftovers, with sizes and what uses each) and who holds it now (``holders``: the
gateways whose locks are on it, the processes that read its files): ``gateway cache``."""
