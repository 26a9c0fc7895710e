"""A CPU-only simulator of one SGLang 0.5.11 server, for tests and planning.

Launched exactly like ``python -m sglang.launch_server`` (same argv, unknown flag -> exit 2):
``python -m workers.sim --model-path Qwen/Qwen3.6-27B --host 127.0.0.1 --port 30001 <flags>``.
It speaks SGLang's HTTP API (native, OpenAI, /server_info, /v1/loads, /metrics) and prints
SGLang's log lines. It is honest by construction: caps and memory come from
:mod:`workers.engine.capacity` (SGLang's arithmetic), step times and accept lengths from the
measured
workload, each cited where it is used. It is not a stand-in for a GPU:
no model runs and the output text is filler.

Environment (``config.settings.SimSettings``): FLEET_SIM_SPEED (step times are divided by it),
FLEET_SIM_MEAN_OUTPUT_TOKENS and FLEET_SIM_OUTPUT_SIGMA (log-normal output lengths),
FLEET_SIM_SEED, FLEET_SIM_GPU_MEMORY_MIB (memory of the simulated GPU), FLEET_SIM_STARTUP_S
(real seconds of simulated loading; the port refuses connections for the first 78 %, then
/health answers 503 through the warmup, as SGLang's does), FLEET_SIM_CALIBRATION (the timing
profile, :mod:`workers.sim.calibration`).
SGLANG_ENABLE_SPEC_V2 (default: the played release's, on in 0.5.11, off in 0.5.10.post1) and
SGLANG_HEALTH_CHECK_TIMEOUT are honoured.
Rates and latencies are real time: at FLEET_SIM_SPEED=k the reported gen throughput is k times the
modelled GPU's (the per-step accept length and the caps do not change).

Fault injection (sim only): a prompt containing ``__SIM_CRASH__`` makes the process exit with
status 1 when the request is admitted to the running batch; a prompt containing ``__SIM_HANG__``
is admitted, holds its slot and never produces a token (abort it with /abort_request); a prompt
containing ``__SIM_ERROR__`` gets the bare HTTP 500 of an exception SGLang's handler does not
catch. The SGLang release played is FLEET_SIM_SGLANG_VERSION (0.5.11 by default; /server_info
reports it).

Step and prefill times come from a calibration profile (FLEET_SIM_CALIBRATION,
:mod:`workers.sim.calibration`: the real job on B200s by default, or real SGLang 0.5.11 on one
H200 with dummy weights, docs/simulator.md). Prefill costs time and prompts that share a
prefix with earlier ones hit the radix cache (:mod:`workers.sim.radix`), unless the engine runs
with ``--disable-radix-cache``.

Not simulated: streaming (``stream: true`` is a 400, where SGLang streams: the fleet never
streams), n > 1 on the OpenAI routes, DP/TP ranks.
"""
