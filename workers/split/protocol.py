"""What the asker and the owner of a split share: the request, the part, and the tag a part's
requests carry in its GPU's share (workers/delivery/gpu_share.py)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import orjson

PART_MARK = "+"  # in a part's GPU-share tag ("job/batch+part"): a part is not split again
REQUEST_TTL_MS = 5000  # an unanswered request (its owner gone) clears itself
PARTS_TTL_S = 7 * 24 * 3600  # leftover part lists of a job never finished


@dataclass(frozen=True)
class Part:
    """The rows of another GPU's batch granted to this run."""

    id: str
    rows: frozenset[str]  # unit keys


@dataclass(frozen=True)
class Request:
    """An idle worker's ask for a batch's unsent rows."""

    part: str
    token: str
    raw: str  # as stored: the grant compares it whole

    @classmethod
    def new(cls, token: str) -> Request:
        """A request under a fresh part id, for the asker's ownership ``token``."""
        part = secrets.token_hex(6)
        return cls(part, token, orjson.dumps({"part": part, "token": token}).decode())

    @classmethod
    def decode(cls, raw: bytes) -> Request | None:
        """None for a value this code did not write."""
        try:
            d = orjson.loads(raw)
            return cls(str(d["part"]), str(d["token"]), raw.decode())
        except (orjson.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            return None


def share_tag(job: str, batch: int, part: Part | None = None) -> str:
    """The GPU-share tag of a batch's run (``job/batch``) or of a part's (``job/batch+part``)."""
    return f"{job}/{batch}" + (f"{PART_MARK}{part.id}" if part else "")


def split_tag(tag: str) -> tuple[str, int] | None:
    """(job, batch) of a GPU-share tag ``job/batch``; None for a part's tag or another one."""
    if PART_MARK in tag:
        return None
    job, _, batch = tag.rpartition("/")
    return (job, int(batch)) if job and batch.isdigit() else None
