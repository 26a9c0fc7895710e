"""Delivery: the code that keeps the promise "every prompt once, nothing lost".

- ``ownership``: the fencing token of the one run that may write a batch's progress and result.
- ``whereabouts``: where each batch is (stored, queued, unacked, held), derived from the store,
  the broker's lists and kombu's unacked hash, and the reconcile that resends the rest.
- ``gate``: stop and restart consuming from the worker's queues (engine down, lease trouble).
"""
