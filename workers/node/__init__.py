"""Who this worker is: its GPU group, its context and its heartbeat."""
