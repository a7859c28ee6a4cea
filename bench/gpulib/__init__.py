"""The parts of bench/gpu_check.py: what the sections share (common), the sections (sections), the report (report)."""
