"""Op families defined as files of their own: each module defines its ``hocompile::`` op and registers its
:class:`~hocompile.registry.OpFamily` when imported (``hocompile.families.polar``)."""
