"""The simulator's timing, as named calibration profiles (FLEET_SIM_CALIBRATION).

``b200-workload`` (the default) models the real job (docs/workload.md): Qwen3.6-27B with MTP on
B200s, accept length ~3.5. ``h200-dummy`` is fitted to real SGLang 0.5.11 on one NVIDIA H200
(2026-12-01; triton attention, pytorch sampling, dummy weights of the 27B-shaped hybrid, MTP
accept length ~1.0; the captures under tests/fixtures/sglang/0.5.11/real-h200/, the figures and
the fit in docs/simulator.md). Both give a decode step in milliseconds as

    step_ms = base + per_req * running + per_context_token * (KV tokens held / running)

and a prefill round (one extend forward, however few its prompts) in seconds as
``prefill_round_ms / 1000 + tokens / prefill_tokens_per_s + sum(len^2) * prefill_sq_s``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """One set of timing constants and the hardware they were measured on."""

    name: str
    step_base_ms: float
    step_per_req_ms: float
    step_per_context_token_ms: float  # per token of the running requests' mean context
    non_spec_step_scale: float  # a step without speculative decoding, relative to an MTP step
    accept_rate: float  # accepted share of each draft token (accept length 1 + rate*(d-1))
    prefill_tokens_per_s: float
    prefill_sq_s: float  # attention cost of a prompt: seconds per (its tokens)^2
    prefill_round_ms: float  # fixed cost of one prefill round, whatever its size
    startup_s: float  # launch to healthy, used when FLEET_SIM_STARTUP_S is not set
    gpu_memory_mib: int  # the GPU, used when FLEET_SIM_GPU_MEMORY_MIB is not set

    def step_ms(self, running: int, mean_context: float, speculative: bool) -> float:
        """Duration of one decode step in milliseconds at real speed."""
        ms = (self.step_base_ms + self.step_per_req_ms * running
              + self.step_per_context_token_ms * mean_context)
        return ms if speculative else ms * self.non_spec_step_scale

    def prefill_s(self, tokens: int, squares: float) -> float:
        """Seconds of one prefill round of ``tokens`` new tokens (``squares``: sum of len^2).

        A round is its own forward that runs instead of a decode step (``Scheduler.
        get_next_batch_to_run``, 0.5.11: a new prefill batch runs first), so its fixed cost
        holds up every running request: the simulator's loop adds it to the step's pace."""
        return (self.prefill_round_ms / 1000 + tokens / self.prefill_tokens_per_s
                + squares * self.prefill_sq_s)


# The real job (0.5.11, Qwen3.6-27B + MTP on B200s, docs/workload.md): ~2,000 output tok/s per
# GPU at 16 running and ~3,500 at 40, accept length ~3.5, so 35.7 steps/s (28 ms) at 16 and 25/s
# (40 ms) at 40: step_ms = 20 + 0.5 * running. No context term was measured there. The operators
# credited MTP with ~3x at accept 3.5, so a step without it costs 3 / 3.5 (inferred). Accept
# rate (3.5 - 1) / (4 - 1). Prefill 20,000 tok/s is the order of a 27B prefill on a B200
# (inferred, not measured); no fixed cost per round was measured there.
B200_WORKLOAD = Calibration(
    name="b200-workload",
    step_base_ms=20.0,
    step_per_req_ms=0.5,
    step_per_context_token_ms=0.0,
    non_spec_step_scale=3.0 / 3.5,
    accept_rate=2.5 / 3.0,
    prefill_tokens_per_s=20_000.0,
    prefill_sq_s=0.0,
    prefill_round_ms=0.0,
    startup_s=1.0,
    gpu_memory_mib=183_359,
)

# Real SGLang 0.5.11 on one H200, 2026-12-01 (docs/simulator.md, "Calibration"): least squares
# over the 85 steady Decode batch lines of big80, big200 and big200_40 (1, 8, 16 and 40
# running, 270 to 8,094 tokens of context per request) gives 19.13 + 0.788 * running +
# 0.002394 * mean context ms (rms 0.34 ms, worst 0.93 ms): 38.8 ms at 1 running with 8 k of
# context, 32.5 at 16, 51.5 at 40. Accept length 1.008 (random weights) -> rate 0.008 / 3.
# Prefill: every round costs 128 ms however small (147 decode intervals of the gpu-check's
# short-row jobs, 10.5 rounds of ~33 tokens each per interval, 2026-12-01 12:04 and 12:26 runs);
# 34 prompts (8,192 tokens) in one chunk took <= 333 ms and one 8,184-token prompt 1.28 s end
# to end -> 45,000 tok/s plus 1.45e-8 s per token^2 on top of the round. Start-up: 85, 102,
# 117 s from launch to a healthy /health (the three hybrid starts). A step without MTP was not
# measured: the B200 ratio stands (inferred). 143,771 MiB: nvidia-smi memory.total.
H200_DUMMY = Calibration(
    name="h200-dummy",
    step_base_ms=19.13,
    step_per_req_ms=0.788,
    step_per_context_token_ms=0.002394,
    non_spec_step_scale=3.0 / 3.5,
    accept_rate=0.008 / 3.0,
    prefill_tokens_per_s=45_000.0,
    prefill_sq_s=1.45e-8,
    prefill_round_ms=128.0,
    startup_s=102.0,
    gpu_memory_mib=143_771,
)

PROFILES = {c.name: c for c in (B200_WORKLOAD, H200_DUMMY)}


def calibration(name: str) -> Calibration:
    """The profile called ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"FLEET_SIM_CALIBRATION={name!r} is not a calibration (known: {', '.join(PROFILES)})"
        ) from None
