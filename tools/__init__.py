"""Tools for developing loragate: benchmarks, the soak, the test harness and a stand-in engine.

Not part of the installed package (``pip install .`` ships ``loragate`` only). They run from a
checkout: ``python -m tools.bench`` from its root, ``scripts/*.py``, and the test suite, whose
conftest puts the checkout on ``PYTHONPATH`` for the processes the tests start.
"""
