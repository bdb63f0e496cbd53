"""``python -m jetson_tq MODE``: the command line behind run_jetson.sh."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
