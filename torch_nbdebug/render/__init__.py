"""Renderers: text, static SVG/HTML and widgets. They read data objects only, never the recorders."""
