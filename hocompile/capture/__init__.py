"""Capture: an optimizer's ``step()`` traced into a functional aten FX graph plus a binding plan.

``trace.py`` holds :func:`~hocompile.capture.trace.trace.capture`; the other modules are the pieces it
uses: where inputs live (``slots.py``), host values and reads (``scalars.py``, ``host_*.py``),
containers, stand-ins, the opaque calls it keeps whole (fused kernels, compiled helpers,
collectives) and what it must restore (``snapshot.py``). Nothing is imported here, so a module
that needs one piece does not load the tracer.
"""
