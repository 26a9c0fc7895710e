"""SGLang's MambaPool: the bytes of one slot, the speculative states and slots reserved before
the KV pool (``handle_max_mamba_cache``), and the buffers the ``Mamba Cache is allocated`` line
reports. Used by :mod:`workers.engine.capacity`, which re-exports these names."""

from __future__ import annotations

from workers.engine.model_config import ModelShape
from workers.engine.server_args import (
    EngineFlags,
    mamba_ratio,
    num_draft_tokens,
    release,
    speculative,
    speculative_params,
)

GIB = 1024**3


def ssm_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """SSM state of one slot per GPU, honouring ``--mamba-ssm-dtype`` (bf16 halves fp32)."""
    ssm = shape.mamba_bytes_per_slot - shape.mamba_conv_bytes_per_slot
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    dtype = flags.mamba_ssm_dtype or shape.mamba_ssm_dtype
    return ssm * sizes.get(dtype, 4) / sizes.get(shape.mamba_ssm_dtype, 4) / flags.tp_size


def conv_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """Conv state of one slot per GPU: ``conv_dim / tp x (kernel - 1)``, where groups that TP does
    not divide are first padded to ``tp`` (``configs/mamba_utils.py``:
    ``extra_groups_for_head_shards``, ``Mamba2StateShape.create``; Mamba-2 with ``n_groups`` 1
    at tp 8 holds 8 groups' B and C), in ``SGLANG_MAMBA_CONV_DTYPE`` (bf16 by default)."""
    tp, groups = flags.tp_size, shape.mamba_groups
    conv = shape.mamba_conv_bytes_per_slot
    if tp > 1 and groups and groups % tp:
        base = shape.mamba_intermediate + 2 * groups * shape.mamba_state_size
        padded = shape.mamba_intermediate + 2 * tp * shape.mamba_state_size
        conv = conv * padded / base
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    return conv * sizes.get(flags.mamba_conv_dtype or "bfloat16", 2) / 2 / tp


def mamba_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """``mamba_cache_per_req``: conv + SSM state of one slot per GPU."""
    return ssm_bytes_per_slot(shape, flags) + conv_bytes_per_slot(shape, flags)


def handle_max_mamba_cache(
    rest_gib: float, per_slot: float, flags: EngineFlags, cli_cap: int | None
) -> tuple[float, int]:
    """Reserve speculative states and Mamba slots; return (GiB left for KV, slot count).

    ``spec_reservation`` of the release (``handle_max_mamba_cache``):

    - ``cli_cap`` (0.5.10-0.5.12, ``model_runner_kv_cache_mixin.py``): ``per_slot * cli_cap *
      D`` first, then the slots from what is left;
    - ``capped`` (0.5.13-0.5.16, the same file; ``mem_cache/kv_cache_configurator.py::
      _handle_max_mamba_cache`` from 0.5.16): an automatic budget is split jointly, ``slots =
      budget // (per_slot * (1 + D / R))``, and ``min(cli_cap, slots // R) * D`` states kept;
    - ``capped_plus_one`` (0.5.17 on, ``kv_cache_configurator.py``): the same for one request
      more, the budget less ``per_slot * (1 + D)`` first, and (``mamba_pool_padding``) the
      padding slot charged: ``slots = (budget - per_slot) // per_slot`` without speculation,
      ``(slots + 1) * per_slot`` taken from the rest.
    """
    found = release(flags)
    if found.spec_reservation == "cli_cap":
        return _reserve_for_cli_cap(rest_gib, per_slot, flags, cli_cap)
    plus = 1 if found.spec_reservation == "capped_plus_one" else 0
    spec = speculative(flags) and cli_cap is not None
    draft = num_draft_tokens(flags)
    pad = 1 if found.mamba_pool_padding else 0
    ratio_r = mamba_ratio(flags)
    if flags.max_mamba_cache_size is not None:
        slots = flags.max_mamba_cache_size
        if spec:
            capped = min(cli_cap, slots // ratio_r)  # type: ignore[type-var]
            rest_gib -= per_slot * (capped + plus) * draft / GIB
    elif flags.disable_radix_cache and cli_cap is not None:
        slots = cli_cap
        if spec:
            rest_gib -= per_slot * (slots + plus) * draft / GIB
    else:
        full = flags.mamba_full_memory_ratio
        budget = rest_gib * full / (1 + full) * GIB
        if spec:
            slots = int((budget - plus * per_slot * (1 + draft))
                        // (per_slot * (1 + draft / ratio_r)))
            capped = min(cli_cap, slots // ratio_r)  # type: ignore[type-var]
            rest_gib -= per_slot * (capped + plus) * draft / GIB
        else:
            slots = int((budget - pad * per_slot) // per_slot)
    return rest_gib - (slots + pad) * per_slot / GIB, slots


def _reserve_for_cli_cap(
    rest_gib: float, per_slot: float, flags: EngineFlags, cli_cap: int | None
) -> tuple[float, int]:
    """0.5.10-0.5.12 ``handle_max_mamba_cache``: the pre-cap ``cli_cap`` states, then slots."""
    if speculative(flags) and cli_cap is not None:
        rest_gib -= per_slot * cli_cap * num_draft_tokens(flags) / GIB
    if flags.max_mamba_cache_size is not None:
        slots = flags.max_mamba_cache_size
    elif flags.disable_radix_cache and cli_cap is not None:
        slots = cli_cap
    else:
        ratio = flags.mamba_full_memory_ratio
        slots = int(rest_gib * ratio / (1 + ratio) * GIB // per_slot)
    return rest_gib - slots * per_slot / GIB, slots


def conv_window_share(shape: ModelShape, flags: EngineFlags) -> float:
    """The intermediate conv window's size over the dense ``D`` windows of ``K - 1`` columns.

    0.5.17 ``mem_cache/memory_pool.py::_allocate_deduplicated_conv_window`` keeps one window of
    ``D + K - 2`` columns per request where ``conv_window_dedup_enabled`` allows it (CUDA, a
    linear draft chain: topk 1, not KDA): ``(D + K - 2) / (D (K - 1))``. 1 elsewhere. Only the
    allocation shrinks: ``_handle_max_mamba_cache`` still reserves the dense size.
    """
    kernel, draft = shape.mamba_conv_kernel, num_draft_tokens(flags)
    topk = speculative_params(flags)[1] if speculative(flags) else 1
    if not (release(flags).conv_window_dedup and draft and kernel > 1 and topk <= 1):
        return 1.0
    return (draft + kernel - 2) / (draft * (kernel - 1))
