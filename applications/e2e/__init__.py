"""applications/e2e_rlhf.py's parts: presets, the plan of steps, launching, the report."""
