"""What hocompile tells a user about a step: ``explain()`` (``explain.py``), ``plan()`` (``plan.py``)
and the measured cost per op family (``measure_step.py``)."""
