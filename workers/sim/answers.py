"""What the simulator's answers say (FLEET_SIM_ANSWER), so that every quality gate of the fleet
(workers/dataset/quality.py) can be tested against an engine:

- ``normal``: filler text of the drawn length (reasoning first in thinking mode);
- ``near-empty``: the answer is whitespace (thinking mode: two words after the reasoning),
  finishing with ``stop`` as the drawn length says: the seed's disaster;
- ``no-reasoning``: thinking mode, but nothing in ``reasoning_content`` (all of it in
  ``content``), as when the parser found no reasoning;
- ``markers``: thinking mode, the reasoning left in ``content`` between ``<think>`` tags.

Every answer starts with two 3-character words drawn from the request id, so answers of the
same length differ across requests (a real model's do), and the token count is unchanged.
"""

from __future__ import annotations

import functools
import hashlib

from config.settings import SimSettings
from workers.sim.textgen import filler_text

ANSWERS = ("normal", "near-empty", "no-reasoning", "markers")


@functools.cache
def answer_mode() -> str:
    """FLEET_SIM_ANSWER (read once per process); ValueError for an unknown one."""
    mode = SimSettings().answer
    if mode not in ANSWERS:
        raise ValueError(f"FLEET_SIM_ANSWER={mode!r} is not one of {', '.join(ANSWERS)}")
    return mode


def varied(tokens: int, rid: str) -> str:
    """Filler text of ``tokens`` tokens whose first two words come from ``rid``."""
    text = filler_text(tokens)
    mark = hashlib.blake2b(rid.encode(), digest_size=3).hexdigest()
    if tokens == 1:
        return mark[:3]
    return f"{mark[:3]} {mark[3:]}{text[7:]}" if tokens > 1 else text


def plain_text(tokens: int, rid: str) -> str:
    """The text of a /generate or /v1/completions answer."""
    return "\n" if answer_mode() == "near-empty" and tokens else varied(tokens, rid)


def chat_texts(words: int, reasoning: int, thinking: bool, rid: str
               ) -> tuple[str | None, str | None]:
    """(content, reasoning_content) of a chat answer: ``words`` text tokens, the first
    ``reasoning`` of them reasoning when ``thinking``."""
    mode = answer_mode()
    shown = min(reasoning, words) if thinking else 0
    if mode == "near-empty":
        return (varied(min(2, words - shown), rid) if thinking else "\n"), (
            varied(shown, rid) if thinking else None)
    if thinking and mode == "no-reasoning":
        return varied(words, rid), None
    if thinking and mode == "markers":
        return f"<think>{varied(shown, rid)}</think>{varied(words - shown, rid)}", None
    return varied(words - shown, rid), (varied(shown, rid) if thinking else None)
