"""Port blocks for a test's engines and metrics exporters (producer/localfleet.py)."""

from __future__ import annotations

from producer.localfleet import free_port_block


def test_blocks_handed_out_by_one_process_never_overlap() -> None:
    # None of them is bound until its servers start, so a free-port check alone can give the
    # same block twice: a worker's engine and its metrics exporter once shared a port, and its
    # health probe reached its own exporter. 200 draws from ~2,000 bases collide at random
    # (about 9 times).
    blocks = [range(b, b + 8) for b in (free_port_block(8) for _ in range(200))]
    ports = [p for block in blocks for p in block]
    assert len(ports) == len(set(ports))
