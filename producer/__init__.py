"""The producer: read a prompt data set, stage and enqueue it, follow and verify the job."""
