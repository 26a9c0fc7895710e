"""A memory model of one engine: SGLang's pool arithmetic, calibrated from what the engine logged.

The arithmetic is :mod:`workers.engine.capacity` (a mirror of SGLang's own code); the per-slot
and per-token costs start from the model's own config.json (:mod:`workers.engine.model_config`)
and :func:`calibrate` replaces them with what a live engine reports, so a prediction for a
candidate flag set starts from measured costs:

- Mamba state per slot: the ``Mamba Cache is allocated`` line; the pool holds ``slots + 1``
  states and the speculative intermediate buffers ``(cap + 1) * draft_tokens`` more, so
  ``per_slot = (ssm + intermediate_ssm) / (slots + 1 + (cap + 1) * draft)`` (conv alike).
- KV bytes per token: ``KV Cache is allocated. #tokens: N, K size, V size``.
- Free memory before the weights (SGLang's ``pre``): ``Load weight begin. avail mem=``; the
  weights: that less ``Load weight end … avail mem=`` (both printed to 0.01, so this is one
  rounding closer than ``mem usage=``), else ``mem usage=``, else ``/server_info``
  ``internal_states[0].memory_usage.weight``; the second such line is the draft model.
- ``mem_fraction_static``: the resolved value in ``/server_info``; it is the default for
  candidates that do not set the flag, because the engine will resolve it the same way.
- Whatever is left unexplained is booked as ``unexplained`` memory, chosen so that the model
  reproduces the engine's own ``max_total_num_tokens`` for its current flags. On the real
  engine (SGLang 0.5.11, H200) it is under 25 MiB: the log's rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engine import capacity
from workers.engine.capacity import GIB, CapacityPlan, EngineFlags, ModelConfigError, ModelShape
from workers.engine.log import LogFacts
from workers.engine.model_config import shape_from_config
from workers.engine.versions import engine_version, traits, unknown_traits
from workers.tune.readings import Reading


class DoesNotFit(ValueError):
    """SGLang would refuse this flag set (not enough memory, or an invalid combination)."""


class CannotPlan(DoesNotFit):
    """The model's config.json cannot be read: nothing can be predicted (one line, the file
    and the key)."""


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
    # The engine's SGLang release, whose pool arithmetic applies (None: capacity's default).
    sglang_version: str | None = None
    # Evidence the calibration could not read, and what it used instead (never silent).
    unread: list[str] = field(default_factory=list)
    # SGLang's ``pre`` as the engine logged it (None: the GPU's total less the CUDA context).
    free_before_weights_gib: float | None = None
    # Why nothing can be predicted (the model's config.json unreadable); predict() raises it.
    cannot_plan: str | None = None

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
        return EngineFlags.from_flags(merged, self.env, self.spec_v2_default,
                                      self.sglang_version)

    def predict(self, flags: Mapping[str, Any]) -> Prediction:
        """Predict pools and cap for ``flags``; raises DoesNotFit where SGLang would refuse."""
        if self.cannot_plan is not None:
            raise CannotPlan(self.cannot_plan)
        engine_flags = self.engine_flags(flags)
        try:
            plan = capacity.plan_capacity(
                self.shape, engine_flags, self.gpu_memory_mib, self.free_before_weights_gib
            )
        except (RuntimeError, ValueError) as exc:
            raise DoesNotFit(str(exc)) from exc
        mamba = (
            capacity.mamba_breakdown_gib(self.shape, engine_flags, plan)
            if self.shape.hybrid
            else {}
        )
        return Prediction(dict(flags), plan, mamba)


def config_model(
    flags: Mapping[str, Any], gpu_memory_mib: int, env: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> MemoryModel:
    """A model from the config.json of the profile's ``model-path`` alone (no engine to
    calibrate from), or from ``config``, a snapshot's ``model_config`` section (the config
    carried off the node); :class:`CannotPlan` when neither can be read."""
    name = str(flags.get("model-path", ""))
    try:
        if config and isinstance(config.get("config"), Mapping):
            shape = shape_from_config(config["config"], str(config.get("source") or "snapshot"),
                                      name, config.get("index_total"))
        else:
            shape = capacity.model_shape(name)
    except ModelConfigError as exc:
        raise CannotPlan(f"cannot plan: {exc}") from exc
    return MemoryModel(shape, gpu_memory_mib, env=dict(env or {}))


catalog_model = config_model  # the name callers used before the config reader existed


# The log prints GiB to two decimals: a size read from n printed figures is off by up to n x this.
LOG_ROUNDING_GIB = 0.005


def _or_config(measured: float, config: float, tolerance: float) -> float:
    """The config's exact figure when the log's agrees with it to the log's rounding."""
    return config if config and abs(measured - config) <= tolerance else measured


def _per_slot(
    log: LogFacts, cap: int | None, draft: int, share: float = 1.0
) -> tuple[float, float] | None:
    """(ssm, conv) bytes per Mamba state, from the Mamba allocation line; ``share`` is the
    intermediate conv window's size over the dense one (``capacity.conv_window_share``)."""
    mamba = log.mamba
    if mamba is None:
        return None
    states = conv_states = mamba.slots + 1
    ssm, conv = mamba.ssm_gib, mamba.conv_gib
    if mamba.intermediate_ssm_gib is not None and cap and draft:
        inter = (cap + 1) * draft
        ssm += mamba.intermediate_ssm_gib
        conv += mamba.intermediate_conv_gib or 0.0
        states += inter
        conv_states += inter * share
    return ssm * GIB / states, conv * GIB / conv_states


def _calibrate_mamba(
    shape: ModelShape, log: LogFacts, flags: EngineFlags, measured: list[Reading]
) -> ModelShape:
    cap = log.scheduler.max_running_requests if log.scheduler else None
    draft = capacity.num_draft_tokens(flags)
    found = _per_slot(log, cap, draft, capacity.conv_window_share(shape, flags))
    if found is None:
        return shape
    ssm, conv = (x * flags.tp_size for x in found)
    states = log.mamba.slots + 1 if log.mamba else 1
    tolerance = 2 * LOG_ROUNDING_GIB * GIB / states * flags.tp_size
    config_ssm = capacity.ssm_bytes_per_slot(shape, flags) * flags.tp_size
    ssm = _or_config(ssm, config_ssm, tolerance)
    conv = _or_config(conv, shape.mamba_conv_bytes_per_slot, tolerance)
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
    cell /= capacity.kv_dtype_scale(shape, flags)
    tolerance = 2 * LOG_ROUNDING_GIB * GIB / log.kv_tokens * flags.tp_size
    cell = _or_config(cell, shape.kv_bytes_per_token, tolerance)
    measured.append(Reading("kv_bytes_per_token", round(cell), "log KV Cache is allocated"))
    return dataclasses.replace(shape, kv_bytes_per_token=round(cell))


def _weights_from_info(info: Mapping[str, Any]) -> float | None:
    states = info.get("internal_states") or []
    usage = states[0].get("memory_usage") if states and isinstance(states[0], Mapping) else None
    return usage.get("weight") if isinstance(usage, Mapping) else None


def _calibrate_weights(
    shape: ModelShape, log: LogFacts, info: Mapping[str, Any], measured: list[Reading]
) -> ModelShape:
    begin, end = log.weights_begin_avail_gib, log.weights_end_avail_gib
    if begin is not None and end is not None:
        weight = round(begin - end, 2)
        measured.append(Reading("weights_gib", weight, "log Load weight begin - end avail mem"))
        shape = dataclasses.replace(shape, weights_gib=weight)
    elif log.weights_gib is not None:
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
    config: Mapping[str, Any] | None = None,
) -> MemoryModel:
    """A memory model whose costs are measured from a live engine's log and /server_info
    (``config``: the snapshot's copy of the model's config.json, see :func:`config_model`)."""
    info = server_info or {}
    try:
        model = config_model(flags, gpu_memory_mib, env, config)
    except CannotPlan as exc:
        # The engine's own readings still stand; only predictions are refused.
        shape = ModelShape(name=str(flags.get("model-path", "")), weights_gib=0.0,
                           draft_weights_gib=0.0, kv_bytes_per_token=0, mamba_bytes_per_slot=0,
                           hybrid=log.mamba is not None, context_length=0)
        model = MemoryModel(shape, gpu_memory_mib, env=dict(env or {}), cannot_plan=str(exc))
        model.unread = [str(exc)]
        return model
    version = engine_version(info)
    found = traits(version)
    model.spec_v2_default = found.spec_v2_default if found else None
    model.sglang_version = version if found else None
    engine_flags = model.engine_flags(flags)
    measured: list[Reading] = []
    shape = _calibrate_mamba(model.shape, log, engine_flags, measured)
    shape = _calibrate_kv(shape, log, engine_flags, measured)
    shape = _calibrate_weights(shape, log, info, measured)
    if log.scheduler is not None or log.kv_tokens:
        # This engine's own pools are observed: its unexplained memory is measured below.
        shape = dataclasses.replace(shape, unexplained_gib=0.0)
    model.shape, model.measured = shape, measured
    if log.weights_begin_avail_gib is not None:
        # SGLang measured `pre` before it built what comes ahead of the weights (MoE maps).
        model.free_before_weights_gib = log.weights_begin_avail_gib + shape.pre_load_gib
        measured.append(Reading("free_before_weights_gib", log.weights_begin_avail_gib,
                                "log Load weight begin avail mem"))
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
    if version is not None:  # a release newer than the known ones: what is assumed of it
        out += [f"server_info version {version}: {line}" for line in unknown_traits(version)]
    out += [f"log line in a format this tuner does not know: {line!r}" for line in log.unread]
    names = {m.name for m in model.measured}
    if "kv_bytes_per_token" not in names:
        out.append(f"KV bytes per token from the model's config ({model.shape.source}): no "
                   "readable 'KV Cache is allocated' line in the log")
    if model.shape.hybrid and "mamba_ssm_bytes_per_slot" not in names:
        out.append(f"Mamba state per slot from the model's config ({model.shape.source}): no "
                   "readable 'Mamba Cache is allocated' line in the log")
    if "weights_gib" not in names:
        out.append(f"weights from the model's config ({model.shape.weights_source}): no "
                   "'Load weight end' line and no server_info memory_usage")
    if "free_before_weights_gib" not in names:
        out.append("free memory before the weights: the GPU's total less "
                   f"{capacity.STARTUP_USED_GIB:.2f} GiB (CUDA context measured on an H200): no "
                   "'Load weight begin' line in the log")
    if log.scheduler is None and not log.kv_tokens:
        out.append("no observed max_total_num_tokens: the memory model is not fitted to "
                   "this engine")
    return out
