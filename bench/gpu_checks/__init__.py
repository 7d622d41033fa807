"""bench/gpu_check.py's checks, one section group a module."""
