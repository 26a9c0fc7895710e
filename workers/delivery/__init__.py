"""Delivery: the code that keeps the promise "every prompt once, nothing lost" (docs/delivery.md).

- ``ownership``: the fencing token of the one run that may write a batch's progress and result.
- ``whereabouts``: where each batch is (stored, queued, unacked, held), derived from the store,
  the broker's lists and kombu's unacked hash, and the reconcile that resends the rest.
- ``lease``: the worker's renewal of kombu's visibility lease, with its watchdog.
- ``gate``: stop and restart consuming from the worker's queues (engine down, lease trouble).
- ``jobstate``: Redis keys, counters and the Lua calls that record rows and finish a batch.
- ``progress``: answered rows of a running batch, spilled to the store in chunks.
- ``crashes`` / ``stall``: poison prompts and hung engines.
- ``gpu_share``: one in-flight budget per GPU, shared by its batches oldest first.
"""
