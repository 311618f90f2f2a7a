"""Backends the interpreter runs programs on (see base.py for the interface)."""
