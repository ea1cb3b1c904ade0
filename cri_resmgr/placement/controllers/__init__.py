"""Resource controllers of the placement engine: RDT allocation, block-IO and real-time classes.

Import :mod:`.manager` for :class:`~.manager.ControlManager`; this package file stays empty so that the
configuration model can use the pure :mod:`.schemata` checks without loading the controllers.
"""
