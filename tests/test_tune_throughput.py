"""The throughput curve comes from the engine at steady state, never from warm-up lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.log import BatchLine, parse_batch, parse_log
from workers.tune import snapshot, throughput
from workers.tune.apply import MIN_GAIN
from workers.tune.throughput import fit, steady_decode_points, steady_sample_points

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
BIG80 = SNAPSHOTS / "real_h200_big80"
BIG200_40 = SNAPSHOTS / "real_h200_big200_40"


def _line(running: int, tok_s: float, queued: int) -> BatchLine:
    line = parse_batch(
        f"Decode batch, #running-req: {running}, #full token: {running * 300}, full token usage: "
        f"0.01, mamba num: {running * 4}, mamba usage: 0.80, accept len: 1.00, accept rate: "
        f"0.00, cuda graph: True, gen throughput (token/s): {tok_s:.2f}, #queue-req: {queued}"
    )
    assert line is not None
    return line


def test_ramp_and_drain_lines_are_not_steady_state():
    lines = [
        _line(1, 26.0, 0),  # a lone request (client-held, not the cap)
        _line(8, 250.0, 40),  # admitting: queue waiting but below the cap of 16
        _line(16, 190.0, 184),  # first line at the cap: its interval covers the ramp
        _line(16, 488.0, 184),
        _line(16, 363.0, 168),  # a refill inside steady state still counts
        _line(16, 494.0, 0),  # the queue ran dry: the client, not the cap, holds the count
        _line(8, 297.0, 0),  # drain
    ]
    assert steady_decode_points(lines, cap=16) == [(16, 488.0), (16, 363.0)]


def test_near_the_cap_counts_as_at_the_cap():
    lines = [_line(40, 700.0, 10), _line(39, 690.0, 12), _line(30, 600.0, 9)]
    assert steady_decode_points(lines, cap=40) == [(39, 690.0)]
    assert throughput.at_cap(38, 40) and not throughput.at_cap(37, 40)


def test_the_real_baseline_log_gives_steady_state_at_16_only():
    # The capture's probes ran 1 and 2 requests, the load drained at 8: those lines are what
    # the old fit read as a knee at 20 (1->24, 2->16, 8->280, 16->432 tok/s).
    facts = parse_log((BIG80 / "engine.log").read_text())
    counts = {line.number("#running-req") for line in facts.decode_lines()}
    assert {1, 2, 8, 16} <= counts
    points = steady_decode_points(facts.decode_lines(), cap=16)
    assert {n for n, _ in points} == {16}
    assert all(line.number("#queue-req") for line in facts.decode_lines()
               if (line.number("#running-req"), line.number("gen throughput (token/s)"))
               in points)
    model = fit(points)
    assert model.knee() is None and not model.saturated_at(16)
    assert model.measured_up_to == 16 and "unmeasured above 16 running" in model.source
    assert "1->" not in model.source and "8->" not in model.source
    # Steady state: the real whole-run figure was 398 tok/s, decode alone ~490.
    assert 400 < model.tok_s(16) < 500


def test_sampled_gauges_count_each_decode_line_once_and_skip_the_ramp():
    samples = snapshot.load(BIG80)["samples"]
    points = steady_sample_points(samples)
    throughputs = [y for _, y in points]
    assert len(throughputs) == len(set(throughputs)) > 20
    assert {n for n, _ in points} <= {15, 16}  # at the cap of 16 (within one request)
    decode = parse_log((BIG80 / "engine.log").read_text()).decode_lines()
    first_at_cap = next(x for x in decode if x.number("#running-req") == 16)
    assert first_at_cap.number("gen throughput (token/s)") not in [round(y, 2) for y in
                                                                   throughputs]
    assert steady_sample_points(snapshot.load(BIG200_40)["samples"])[0][0] == 40


@pytest.mark.parametrize(
    "points",
    [
        [(16, 432.0)],  # one steady count
        [(16, 432.0), (40, 704.0)],  # two: they fix the curve's two numbers and test nothing
        [(14, 400.0), (15, 420.0), (16, 432.0)],  # three, but a range of 1.14x
    ],
)
def test_too_few_or_too_close_counts_are_no_knee_and_no_compute(points):
    model = fit(points)
    assert model.knee() is None and not model.shape_measured
    assert not model.saturated_at(max(n for n, _ in points))


def test_three_counts_over_a_wide_range_measure_a_knee():
    curve = throughput.ThroughputModel(1000.0, 10.0, "truth")
    model = fit([(n, curve.tok_s(n)) for n in (8, 16, 40)])
    assert model.shape_measured
    assert model.half_n == pytest.approx(10.0, rel=1e-6)
    assert model.knee() == 30 and model.saturated_at(40) and not model.saturated_at(8)


def test_two_wide_counts_that_give_no_more_are_flat():
    flat = fit([(16, 3400.0), (40, 3500.0)])  # 2.5x the running, +3 % tokens
    assert flat.shape_measured and flat.saturated_at(40)
    rising = fit([(16, 3400.0), (40, 3700.0)])  # +9 %: would pass a canary
    assert not rising.shape_measured and not rising.saturated_at(40)


def test_flat_is_the_gain_a_canary_would_roll_back():
    assert throughput.CANARY_MIN_GAIN == throughput.FLAT_GAIN == MIN_GAIN
