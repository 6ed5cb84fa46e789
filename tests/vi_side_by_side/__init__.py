"""The Vi SDK's server and loragate side by side: what the difference table in docs/vi-sdk.md is
made from.

``corpus``: the requests, as data. ``servers``: the recording backend, the two servers and one
observation. ``recognise`` and ``differences``: each difference, how it is recognised and why
it is deliberate. ``run``: the whole corpus through both, each case's verdict and the table.
``python -m tests.vi_side_by_side --write-docs`` writes the table (tests/unit/test_vi_differences.py
checks it).
"""
