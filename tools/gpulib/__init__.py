"""The parts of tools/gpu_check.py: what the sections share (common), the sections (sections), the report (report)."""
