"""Pure functions from data to data (collapse modules, first non-finite, downsample a timeline)."""
