"""The ``hocompile::`` ops: one file per op family, each defining its op and registering its
:class:`~hocompile.ir.registry.OpFamily` when imported (``hocompile.ops.polar``).

Newton–Schulz is three files: ``newton_schulz.py`` defines the op (CPU kernel and fake),
``newton_schulz_spec.py`` its named arguments and registry entry, and ``newton_schulz_math.py``
the maths behind it (standard and Gram NS, restarts, the rounding model), which the precision
planner uses too. Nothing is imported here, so importing the maths registers no op.
"""
