"""The data set: the store, its location, job records, the sink and its lock, the manifest
and verify."""
