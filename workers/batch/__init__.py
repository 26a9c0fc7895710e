"""One batch run: the runner that drives the engine at full concurrency and its parts."""
