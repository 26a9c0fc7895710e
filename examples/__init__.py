"""Runnable recipes (docs/recipes.md): ``python -m examples.run NAME`` on the simulator."""
