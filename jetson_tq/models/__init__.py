"""Real models and text shipped by PyPI packages (offline): SmolLM2-135M and the Paul Graham essays."""
