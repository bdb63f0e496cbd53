"""The package version (image tags, reports); run_jetson.sh keeps the same string."""

__version__ = "0.1.0"
