"""The Python twins of the magics: each wires a recorder, the processors and a renderer together."""
