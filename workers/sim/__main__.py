"""``python -m workers.sim <SGLang launch flags>``: run the simulated SGLang engine."""

import os
import sys

from workers.sim.server import main

status = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown (seconds on a busy box, nothing left to clean): a stop signal must
# end the process within a second.
os._exit(status)
