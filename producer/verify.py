"""Verify a job from the result store alone; the logic lives in :mod:`workers.verify`."""

from workers.verify import verify_job

__all__ = ["verify_job"]
