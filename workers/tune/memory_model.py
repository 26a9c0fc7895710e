"""A memory model of one engine: SGLang's pool arithmetic, calibrated from what the engine logged.

The arithmetic is :mod:`workers.engine.capacity` (a mirror of SGLang's own code). Its model
catalogue
holds per-slot and per-token costs for known models; :func:`calibrate` replaces them with what a
live engine reports, so a prediction for a candidate flag set starts from measured costs:

- Mamba state per slot: the ``Mamba Cache is allocated`` line; the pool holds ``slots + 1``
  states and the speculative intermediate buffers ``(cap + 1) * draft_tokens`` more, so
  ``per_slot = (ssm + intermediate_ssm) / (slots + 1 + (cap + 1) * draft)`` (conv alike).
- KV bytes per token: ``KV Cache is allocated. #tokens: N, K size, V size``.
- Weights: ``Load weight end … mem usage=`` (the second such line is the draft model), else
  ``/server_info`` ``internal_states[0].memory_usage.weight``.
- ``mem_fraction_static``: the resolved value in ``/server_info``; it is the default for
  candidates that do not set the flag, because the engine will resolve it the same way.
- Whatever is left unexplained (the CUDA context, free memory measured before the weights
  rather than the whole GPU) is booked as ``unexplained`` memory, chosen so that the model
  reproduces the engine's own ``max_total_num_tokens`` for its current flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engine import capacity
from workers.engine.capacity import GIB, CapacityPlan, EngineFlags, ModelShape
from workers.engine.log import LogFacts
from workers.engine.versions import engine_version, supported_list, traits
from workers.tune.readings import Reading


class DoesNotFit(ValueError):
    """SGLang would refuse this flag set (not enough memory, or an invalid combination)."""


@dataclass(frozen=True)
class Prediction:
    """What the engine would allocate and apply for one flag set."""

    flags: dict[str, Any]
    plan: CapacityPlan
    mamba_gib: dict[str, float]

    @property
    def cap(self) -> int:
        """Effective running cap."""
        return self.plan.max_running_requests

    def to_json(self) -> dict[str, Any]:
        """The ``predicted`` object of ``diagnose --json``."""
        return {
            "max_running_requests": self.plan.max_running_requests,
            "mamba_slots": self.plan.max_mamba_cache_size,
            "mamba_ratio": self.plan.mamba_ratio,
            "kv_tokens": self.plan.max_total_num_tokens,
            "mem_fraction_static": round(self.plan.mem_fraction_static, 4),
            "memory_gb": {k: round(v, 2) for k, v in self.plan.memory_gib.items()},
            "mamba_gb": {k: round(v, 2) for k, v in self.mamba_gib.items()},
        }


@dataclass
class MemoryModel:
    """Predicts caps and memory maps for candidate flags on one GPU."""

    shape: ModelShape
    gpu_memory_mib: int
    # Resolved mem_fraction_static of the running engine (default for candidates).
    mem_fraction_static: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    measured: list[Reading] = field(default_factory=list)
    # SGLANG_ENABLE_SPEC_V2's default in the engine's release (None: workers.engine.capacity's).
    spec_v2_default: bool | None = None
    # Evidence the calibration could not read, and what it used instead (never silent).
    unread: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"<MemoryModel {self.shape.name} gpu={self.gpu_memory_mib}MiB "
            f"slot={self.shape.mamba_bytes_per_slot}B kv={self.shape.kv_bytes_per_token}B/token>"
        )

    def engine_flags(self, flags: Mapping[str, Any]) -> EngineFlags:
        """SGLang's view of ``flags`` (observed mem_fraction_static unless set)."""
        merged = dict(flags)
        if "mem-fraction-static" not in merged and self.mem_fraction_static is not None:
            merged["mem-fraction-static"] = self.mem_fraction_static
        return EngineFlags.from_flags(merged, self.env, self.spec_v2_default)

    def predict(self, flags: Mapping[str, Any]) -> Prediction:
        """Predict pools and cap for ``flags``; raises DoesNotFit where SGLang would refuse."""
        engine_flags = self.engine_flags(flags)
        try:
            plan = capacity.plan_capacity(self.shape, engine_flags, self.gpu_memory_mib)
        except (RuntimeError, ValueError) as exc:
            raise DoesNotFit(str(exc)) from exc
        mamba = (
            capacity.mamba_breakdown_gib(self.shape, engine_flags, plan)
            if self.shape.hybrid
            else {}
        )
        return Prediction(dict(flags), plan, mamba)


def catalog_model(
    flags: Mapping[str, Any], gpu_memory_mib: int, env: Mapping[str, str] | None = None
) -> MemoryModel:
    """A model from the catalogue alone (no engine to calibrate from)."""
    shape = capacity.model_shape(str(flags.get("model-path", "")))
    return MemoryModel(shape, gpu_memory_mib, env=dict(env or {}))


def _per_slot(log: LogFacts, cap: int | None, draft: int) -> tuple[float, float] | None:
    """(ssm, conv) bytes per Mamba state, from the Mamba allocation line."""
    mamba = log.mamba
    if mamba is None:
        return None
    states = mamba.slots + 1
    ssm, conv = mamba.ssm_gib, mamba.conv_gib
    if mamba.intermediate_ssm_gib is not None and cap and draft:
        inter = (cap + 1) * draft
        ssm += mamba.intermediate_ssm_gib
        conv += mamba.intermediate_conv_gib or 0.0
        states += inter
    return ssm * GIB / states, conv * GIB / states


def _calibrate_mamba(
    shape: ModelShape, log: LogFacts, flags: EngineFlags, measured: list[Reading]
) -> ModelShape:
    cap = log.scheduler.max_running_requests if log.scheduler else None
    draft = capacity.num_draft_tokens(flags)
    found = _per_slot(log, cap, draft)
    if found is None:
        return shape
    ssm, conv = (x * flags.tp_size for x in found)
    measured.append(Reading("mamba_ssm_bytes_per_slot", round(ssm), "log Mamba Cache is allocated"))
    measured.append(
        Reading("mamba_conv_bytes_per_slot", round(conv), "log Mamba Cache is allocated")
    )
    return dataclasses.replace(
        shape,
        hybrid=True,
        mamba_bytes_per_slot=round(ssm + conv),
        mamba_conv_bytes_per_slot=round(conv),
        mamba_ssm_dtype=flags.mamba_ssm_dtype or shape.mamba_ssm_dtype,
    )


def _calibrate_kv(
    shape: ModelShape, log: LogFacts, flags: EngineFlags, measured: list[Reading]
) -> ModelShape:
    if not log.kv_tokens or not log.kv_gib:
        return shape
    cell = log.kv_gib * GIB / log.kv_tokens * flags.tp_size
    cell /= capacity.KV_DTYPE_SCALE.get(flags.kv_cache_dtype, 1.0)
    measured.append(Reading("kv_bytes_per_token", round(cell), "log KV Cache is allocated"))
    return dataclasses.replace(shape, kv_bytes_per_token=round(cell))


def _weights_from_info(info: Mapping[str, Any]) -> float | None:
    states = info.get("internal_states") or []
    usage = states[0].get("memory_usage") if states and isinstance(states[0], Mapping) else None
    return usage.get("weight") if isinstance(usage, Mapping) else None


def _calibrate_weights(
    shape: ModelShape, log: LogFacts, info: Mapping[str, Any], measured: list[Reading]
) -> ModelShape:
    if log.weights_gib is not None:
        measured.append(Reading("weights_gib", log.weights_gib, "log Load weight end mem usage"))
        shape = dataclasses.replace(shape, weights_gib=log.weights_gib)
    elif (weight := _weights_from_info(info)) is not None:
        measured.append(
            Reading("weights_gib", weight, "server_info internal_states[0].memory_usage.weight")
        )
        shape = dataclasses.replace(shape, weights_gib=float(weight))
    if log.draft_weights_gib is not None:
        measured.append(
            Reading("draft_weights_gib", log.draft_weights_gib, "log second Load weight end")
        )
        shape = dataclasses.replace(shape, draft_weights_gib=log.draft_weights_gib)
    return shape


def _fit_offset(model: MemoryModel, flags: Mapping[str, Any], kv_tokens: int | None) -> None:
    """Book the memory the arithmetic does not explain as such, so the current flags give the
    engine's observed KV tokens."""
    if not kv_tokens:
        return
    try:
        predicted = model.predict(flags).plan.max_total_num_tokens
    except DoesNotFit:
        return
    engine_flags = model.engine_flags(flags)
    offset = (predicted - kv_tokens) * capacity.kv_cell_bytes(model.shape, engine_flags) / GIB
    offset *= engine_flags.tp_size
    unexplained = model.shape.unexplained_gib + offset
    model.shape = dataclasses.replace(model.shape, unexplained_gib=unexplained)
    model.measured.append(
        Reading("unattributed_gib", round(offset, 3), "fit to the engine's max_total_num_tokens")
    )


def calibrate(
    flags: Mapping[str, Any],
    gpu_memory_mib: int,
    log: LogFacts,
    server_info: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> MemoryModel:
    """A memory model whose costs are measured from a live engine's log and /server_info."""
    info = server_info or {}
    model = catalog_model(flags, gpu_memory_mib, env)
    version = engine_version(info)
    found = traits(version)
    model.spec_v2_default = found.spec_v2_default if found else None
    engine_flags = model.engine_flags(flags)
    measured: list[Reading] = []
    shape = _calibrate_mamba(model.shape, log, engine_flags, measured)
    shape = _calibrate_kv(shape, log, engine_flags, measured)
    shape = _calibrate_weights(shape, log, info, measured)
    if log.scheduler is not None or log.kv_tokens:
        # This engine's own pools are observed: its unexplained memory is measured below
        # (unattributed_gib), not the catalogue's figure from another run.
        shape = dataclasses.replace(shape, unexplained_gib=0.0)
    model.shape, model.measured = shape, measured
    fraction = info.get("mem_fraction_static")
    if fraction is not None:
        model.mem_fraction_static = float(fraction)
        measured.append(Reading("mem_fraction_static", fraction, "server_info mem_fraction_static"))
    observed = log.scheduler.max_total_num_tokens if log.scheduler else log.kv_tokens
    _fit_offset(model, flags, observed)
    model.unread = _unread(version, log, model)
    return model


def _unread(version: str | None, log: LogFacts, model: MemoryModel) -> list[str]:
    """What the calibration could not read from this engine, and what it used instead."""
    out = []
    if version is not None and traits(version) is None:
        out.append(
            f"server_info version {version}: not a supported SGLang release ({supported_list()}); "
            "its log formats and pool arithmetic may differ from the ones used here"
        )
    out += [f"log line in a format this tuner does not know: {line!r}" for line in log.unread]
    names = {m.name for m in model.measured}
    if "kv_bytes_per_token" not in names:
        out.append("KV bytes per token from the model catalogue: no readable "
                   "'KV Cache is allocated' line in the log")
    if model.shape.hybrid and "mamba_ssm_bytes_per_slot" not in names:
        out.append("Mamba state per slot from the model catalogue: no readable "
                   "'Mamba Cache is allocated' line in the log")
    if "weights_gib" not in names:
        out.append("weights from the model catalogue: no 'Load weight end' line and no "
                   "server_info memory_usage")
    if log.scheduler is None and not log.kv_tokens:
        out.append("no observed max_total_num_tokens: the memory model is not fitted to "
                   "this engine")
    return out
