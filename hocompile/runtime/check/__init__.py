"""Checks of a compiled step against eager: ``verify=N`` with fp64 references (``verify.py``), the
sampled self-check on by default (``self_check.py`` and the ``compare``/``gemms``/``ranks``/``slices``/
``view`` helpers), judging a step against eager's own spread (``judgement*.py``) and the eager
references they run (``reference_step.py``, ``reference_classes.py``). ``checked_run.py`` ties them
to a step.
"""
