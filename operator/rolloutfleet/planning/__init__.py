"""Pure planners: observed state in, next actions out. No I/O, no clock reads, no kopf.

Called by ``rolloutfleet.reconcile``; tested with tables in ``tests/unit/planning``.
"""
