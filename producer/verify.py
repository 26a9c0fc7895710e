"""Verify a job from the result store alone; the logic lives in :mod:`workers.dataset.verify`."""

from workers.dataset.verify import verify_job

__all__ = ["verify_job"]
