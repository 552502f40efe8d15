"""The kopf layer: thin decorated handlers that call the level-triggered reconcilers.

Loaded by ``rolloutfleet run`` (kopf imports ``rolloutfleet.handlers.wiring``). Nothing else imports it.
"""
