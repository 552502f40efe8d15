"""Level-triggered reconcilers: observe → pure plan/build → apply → status (written only when changed).

Called by ``rolloutfleet.handlers`` only. ``fleet.reconcile_fleet`` owns a fleet's children and its
replica/pod status; ``revision`` owns the weight-update transaction and the revision fields of statuses.
"""
