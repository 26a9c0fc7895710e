"""The names every process routes by: the fleet's queues and its tasks.

A GPU worker consumes ``gpu`` (every batch is sent there) and its own ``gpuN`` queue; the sink
worker consumes ``sink``. Producers, workers and the sink all import these names from here.
"""

from __future__ import annotations

SHARED_QUEUE = "gpu"
SINK_QUEUE = "sink"
BATCH_TASK = "fleet.run_batch"
SINK_TASK = "fleet.sink_job"
# Rows of another GPU's batch, asked for at the job's end (workers/split/).
TAKE_TASK = "fleet.take_rows"
