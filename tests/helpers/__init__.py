"""Test helpers: shared cases, the fake-board sandbox, engines side by side (tests only, never the package)."""
