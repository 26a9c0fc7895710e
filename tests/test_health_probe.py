"""The worker's engine monitor sends no /health probe while the engine is plainly serving.

SGLang answers ``/health`` by running a 1-token generation through its scheduler
(``http_server.health_generate``; the simulator does the same), so a probe every few seconds
takes a slot of a prefill round from the job's rows. The decode counter the stall watch reads
on every check already proves the engine serves; the probe is kept for an idle engine and for
one whose counter stands still.
"""

from __future__ import annotations

import time

from tests.conftest import run_producer, wait_done, write_prompts
from workers.node.heartbeat import read_heartbeats

INTERVAL_S = 0.2


def _heartbeat(r, key: str) -> int:
    beats = read_heartbeats(r)
    assert len(beats) == 1, beats
    return int(beats[0][key])


def test_no_health_probe_while_the_decode_counter_moves(fleet_env, make_workers, tmp_path, r):
    make_workers([0], FLEET_ENGINE_HEALTH_INTERVAL_S=str(INTERVAL_S),
                 FLEET_HEARTBEAT_INTERVAL_S="0.2", FLEET_SIM_SPEED="2",
                 FLEET_SIM_MEAN_OUTPUT_TOKENS="200")
    time.sleep(1.0)  # idle: the monitor probes
    idle_before = _heartbeat(r, "health_probes")
    time.sleep(1.0)
    idle = _heartbeat(r, "health_probes") - idle_before
    assert idle >= 2, f"an idle engine is still probed ({idle} probes in 1 s)"

    src = write_prompts(tmp_path / "p.jsonl", 120)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "hp").returncode == 0
    t0 = time.monotonic()
    while r.scard("fleet:job:hp:done") == 0 and not r.keys("fleet:job:hp:owner:*"):
        assert time.monotonic() - t0 < 60, "no batch taken"
        time.sleep(0.05)
    before = _heartbeat(r, "health_probes")
    st = wait_done(fleet_env, "hp", timeout_s=120)
    during = _heartbeat(r, "health_probes") - before
    busy_s = st["active_s"]
    assert busy_s >= 3, f"the job ran {busy_s} s: too short to tell"
    # One check every 0.2 s would be ~busy_s / 0.2 probes; a few come at the job's start and
    # end, when the counter has not moved between two readings yet or any more.
    assert during <= 0.2 * busy_s / INTERVAL_S, (during, busy_s)
