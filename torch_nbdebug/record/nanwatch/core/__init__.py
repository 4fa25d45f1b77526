"""What every strategy stands on: the birth rules, the event log, events, op helpers, parameters, storages, the per-layer table."""
