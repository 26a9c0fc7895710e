"""Delivery: the code that keeps the promise "every prompt once, nothing lost" (docs/delivery.md).

- ``ownership``: the fencing token of the one run that may write a batch's progress and result.
- ``whereabouts``: where each batch is (stored, queued, unacked, held), derived from the store,
  the broker's lists and kombu's unacked hash, and the reconcile that resends the rest.
- ``janitor``: that reconcile without an operator, one worker a round.
- ``lease``: the worker's renewal of kombu's visibility lease, with its watchdog.
- ``intake``: stop and restart consuming from the worker's queues (engine down, lease trouble).
- ``hold``: the elastic hold: another batch only while those held have nothing left to send.
- ``gpu_share``: one in-flight budget per GPU, shared by its batches oldest first.
- ``jobstate``: a job's counters, stall notes and registration in Redis.
- ``progress``: answered rows of a running batch, spilled to the store in chunks.
- ``job_progress``: a job's progress as every view shows it (status, jobs, metrics, Flower).
- ``crashes`` / ``stall``: poison prompts and hung engines.
- ``batch_size``: a job's batch size when none is given, sized for the fleet that is up.
- ``sink_requests``: asking for a sink run and following it.
- ``quality_live``: a running job's live quality tally and early warning.

Every Redis key and script they use is in workers/redisdb/; the job-end split in workers/split/.
"""
