"""Entry point: ``python -m workers.tune``."""

import sys

from workers.tune.cli import main

sys.exit(main())
