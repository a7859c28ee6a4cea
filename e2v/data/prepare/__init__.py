"""Data preparation: raw footage -> the e2v dataset layout (tools/prepare_data.py), and the
pieces other importers share (the classical background fill)."""
