"""Backends: one package per --mode, each with render.py (pure), proxier.py (apply) and cleanup.py."""
