"""The per-op watch: checks read as each op runs (immediate) or queued and read together (deferred)."""
