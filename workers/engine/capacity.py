"""SGLang 0.5.10/0.5.11 memory-pool and running-cap arithmetic, as pure functions.

Everything here mirrors code read in the SGLang wheels (``srt/server_args.py``,
``srt/model_executor/model_runner_kv_cache_mixin.py``);
each function names the SGLang function it follows. What is *read from source* is the arithmetic
(the reserve formula, the speculative reservation, the Mamba slot rule, ``_resolve_max_num_reqs``).
What is *calibrated* is the model catalogue below: the per-slot Mamba bytes, the KV bytes per
token, the weight sizes and the VLM memory factor of Qwen3.6-27B are fitted to the run observed
on B200s (SGLang 0.5.11, Qwen3.6-27B + MTP), and the derivation is written next to each number.

Simplifications (stated, not hidden): the free memory before weight load is taken as the whole
GPU (SGLang measures it after the CUDA context exists, a few hundred MiB less); page size is 1;
DP attention and pipeline parallelism are not modelled; tensor parallelism divides the weights,
the KV cell and the Mamba state evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

GIB = 1024**3
MIB_PER_GIB = 1024

# Default running cap with speculative decoding (server_args.py::_handle_speculative_decoding).
SPECULATIVE_DEFAULT_MAX_RUNNING = 48
EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
# Algorithms that always turn the overlap scheduler off (server_args.py).
NO_OVERLAP_ALGORITHMS = frozenset({"NGRAM", "DFLASH"})
# Extra reserve in MiB per speculative algorithm (server_args.py::_handle_gpu_memory_settings).
SPECULATIVE_RESERVE_MIB = {"EAGLE": 4096, "EAGLE3": 4096, "NEXTN": 4096, "STANDALONE": 6144}
# Prefill budget of one batch (--max-prefill-tokens default, server_args.py).
DEFAULT_MAX_PREFILL_TOKENS = 16384
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_SCALE = {"fp8_e5m2": 0.5, "fp8_e4m3": 0.5, "fp4_e2m1": 0.25}


@dataclass(frozen=True)
class ModelShape:
    """What a model costs in GPU memory (per GPU at tp=1)."""

    name: str
    weights_gib: float
    draft_weights_gib: float
    kv_bytes_per_token: int
    mamba_bytes_per_slot: int  # conv+ssm state of one slot (0 for non-hybrid)
    hybrid: bool
    context_length: int
    # Conv part of mamba_bytes_per_slot (the rest is SSM state, stored in mamba_ssm_dtype).
    mamba_conv_bytes_per_slot: int = 0
    mamba_ssm_dtype: str = "float32"
    # The vision tower as ServerArgs.adjust_mem_fraction_for_vlm reads it from hf_config's
    # vision_config: (num_hidden_layers, hidden_size); None for a text-only model.
    vision: tuple[int, int] | None = None
    # The draft model's KV bytes per token (its own pool, same #tokens as the target's).
    draft_kv_bytes_per_token: int = 0
    # Pool memory an observed run lacked that the arithmetic here does not explain (GiB per
    # GPU, at tp=1). Stated as such instead of being folded into a fitted factor.
    unexplained_gib: float = 0.0
    model_type: str = "generic"
    architecture: str = "GenericForCausalLM"
    eos_token_id: int = 0


def vlm_mem_factor(vision: tuple[int, int] | None) -> float:
    """``ServerArgs.adjust_mem_fraction_for_vlm`` (server_args.py, 0.5.10.post1/0.5.11).

    ``0.95 * clamp(1 - 0.1 * (layers * hidden^2 / (24 * 1024^2) - 1), 0.8, 1.05)``: the ViT's
    weight count against a ViT-L/14. 1.0 without a vision_config.
    """
    if vision is None:
        return 1.0
    layers, hidden = vision
    ratio = layers * hidden**2 / (24 * 1024**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


# --- Qwen3.6-27B, calibrated to the observed run ------------------------------------------
# SSM state: 48 GDN layers x 48 value heads x 128 x 128 x fp32 = 150,994,944 B = 144 MiB/slot.
#   Check: MambaPool holds slots+1 states -> 81 x 144 MiB = 11.39 GiB (observed 11.39 GB at 80
#   slots) and 201 x 144 MiB = 28.27 GiB (observed 28.27 GB at 200 slots).
# Conv state: 48 layers x (48*128 + 2*16*128) channels x (kernel 4 - 1) x bf16 = 2,949,120 B
#   = 2.81 MiB/slot. Check: 81 -> 0.22 GiB, 201 -> 0.55 GiB (observed 0.22 / 0.55 GB).
# Intermediate (speculative verify) states = per-slot x (n+1) x 4 draft tokens:
#   SSM 17 x 4 x 144 MiB = 9.56 GiB at n=16, 41 x 4 x 144 MiB = 23.06 GiB at n=40 (both observed);
#   conv window 0.19 / 0.45 GiB (both observed). The per-slot numbers are therefore exact fits.
# KV: calibrated, not derived from config.json: the baseline allocated ~35 GB for ~1.14 M tokens,
#   i.e. 32 KiB per token for the full-attention layers (35 GiB / 32 KiB = 1.147 M).
# Weights: 54 GiB as observed; MTP draft head: 0.85 GiB, the second ``Load weight end`` of the
#   launch log (the draft worker loads after the target's pools exist, so the draft's weights and
#   its KV pool come out of the reserve, not out of the pool: model_runner.py /
#   scheduler.py::init_tp_model_worker then maybe_init_draft_worker). Draft KV: 1 layer x 4 KV
#   heads x 128 x 2 x bf16 = 2 KiB per token (2.16 GB for 1,137,037 tokens in the log).
# VLM factor, derived as SGLang derives it: the Qwen3.5/3.6 vision_config names its 27 layers
#   ``depth``, so adjust_mem_fraction_for_vlm's getattr(num_hidden_layers, 24) reads 24, and
#   hidden_size 1152: 0.95 * (1 - 0.1 * (1152^2 / 1024^2 - 1)) = 0.9248.
# Unexplained: with that factor the arithmetic leaves 10.57 GiB more for KV than the observed
#   ~1.14 M tokens (35 GiB) show. Not read in code (a multimodal runtime reservation and the CUDA
#   context measured before the weights are candidates); kept as its own number so the catalogue
#   reproduces the observed pools without hiding the gap in the VLM term. The observed map then
#   closes: ~17.8 GiB of the pool is the stranded speculative reservation (48 reserved, 17
#   allocated, docs/capacity.md) -- most of the "27 GB free".
QWEN36_27B = ModelShape(
    name="Qwen/Qwen3.6-27B",
    weights_gib=54.0,
    draft_weights_gib=0.85,
    kv_bytes_per_token=32 * 1024,
    mamba_bytes_per_slot=150_994_944 + 2_949_120,
    hybrid=True,
    context_length=262_144,
    mamba_conv_bytes_per_slot=2_949_120,
    mamba_ssm_dtype="float32",
    vision=(24, 1152),
    draft_kv_bytes_per_token=2048,
    unexplained_gib=10.57,
    model_type="qwen3_5",
    architecture="Qwen3_5ForConditionalGeneration",
    eos_token_id=151645,
)

# Qwen3-0.6B (dense, public config): 28 layers x 8 KV heads x 128 x 2 (K,V) x bf16 = 112 KiB per
# token; ~0.75 B params in bf16 (tied embeddings) = 1.4 GiB; max_position_embeddings 40,960.
QWEN3_0_6B = ModelShape(
    name="Qwen/Qwen3-0.6B",
    weights_gib=1.4,
    draft_weights_gib=0.0,
    kv_bytes_per_token=28 * 8 * 128 * 2 * 2,
    mamba_bytes_per_slot=0,
    hybrid=False,
    context_length=40_960,
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    eos_token_id=151645,
)

# Fallback for unknown paths: an 8 B dense model (32 layers x 8 KV heads x 128 x 2 x bf16
# = 128 KiB/token, 15 GiB of weights, 32 k context). A placeholder, not a measurement.
GENERIC_8B = ModelShape(
    name="generic-8b",
    weights_gib=15.0,
    draft_weights_gib=0.0,
    kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    mamba_bytes_per_slot=0,
    hybrid=False,
    context_length=32_768,
)

CATALOG: dict[str, ModelShape] = {
    "qwen3.6-27b": QWEN36_27B,
    "qwen3-0.6b": QWEN3_0_6B,
}


def model_shape(model_path: str) -> ModelShape:
    """Shape whose key is a case-insensitive substring of ``model_path``, else generic."""
    lowered = model_path.lower()
    for key, shape in CATALOG.items():
        if key in lowered:
            return shape
    return GENERIC_8B


# --- flags --------------------------------------------------------------------------------


def parse_human_int(value: object) -> int:
    """Parse an int the way SGLang's ``human_readable_int`` does (``32k``, ``1M``, ``128Ki``)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    units = {"ki": 1024, "mi": 1024**2, "gi": 1024**3, "k": 1000, "m": 1000**2, "g": 1000**3}
    for suffix, mult in units.items():
        if text.lower().endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _to_int(value: object) -> int:
    """Parse an ``int`` flag: a plain integer, as argparse's ``type=int`` (no ``32k``)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    return int(str(value).strip())


def _to_float(value: object) -> float:
    """Parse a float flag value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _to_bool(value: object) -> bool:
    """Parse a boolean flag value (True, "true", "1", "yes")."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def _to_str(value: object) -> str:
    """Parse a string flag value."""
    return str(value)


FLAG_ALIASES = {"tensor_parallel_size": "tp_size", "tp": "tp_size"}


@dataclass(frozen=True)
class EngineFlags:
    """The SGLang flags that matter for capacity, with SGLang's defaults."""

    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = 0.9
    mamba_scheduler_strategy: str = "auto"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    tp_size: int = 1
    mamba_ssm_dtype: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    kv_cache_dtype: str = "auto"
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    # SGLANG_ENABLE_SPEC_V2: True by default in 0.5.11, False in 0.5.10.post1 (srt/environ.py).
    enable_spec_v2: bool = True

    @classmethod
    def from_flags(
        cls,
        flags: Mapping[str, object],
        env: Mapping[str, str] | None = None,
        spec_v2_default: bool | None = None,
    ) -> EngineFlags:
        """Build from flag names (dashes or underscores, leading dashes ok); others are ignored.

        ``spec_v2_default`` is the release's default of ``SGLANG_ENABLE_SPEC_V2``
        (:mod:`workers.engine.versions`); the environment variable overrides it.
        """
        known = {f.name: _CONVERTERS[f.name] for f in fields(cls)}
        values: dict[str, object] = {}
        for raw_key, raw_value in flags.items():
            key = raw_key.lstrip("-").replace("-", "_")
            key = FLAG_ALIASES.get(key, key)
            if key in known and raw_value is not None:
                values[key] = known[key](raw_value)
        if spec_v2_default is not None:
            values["enable_spec_v2"] = spec_v2_default
        if env is not None and "SGLANG_ENABLE_SPEC_V2" in env:
            values["enable_spec_v2"] = _to_bool(env["SGLANG_ENABLE_SPEC_V2"])
        return cls(**values)  # type: ignore[arg-type]


_CONVERTERS: dict[str, Callable[[object], object]] = {
    "context_length": _to_int,
    "mem_fraction_static": _to_float,
    "max_running_requests": _to_int,
    "max_mamba_cache_size": _to_int,
    "mamba_full_memory_ratio": _to_float,
    "mamba_scheduler_strategy": _to_str,
    "disable_radix_cache": _to_bool,
    "disable_overlap_schedule": _to_bool,
    "speculative_algorithm": lambda v: str(v).upper(),
    "speculative_num_draft_tokens": _to_int,
    "max_total_tokens": parse_human_int,  # type=human_readable_int in server_args.py
    "chunked_prefill_size": _to_int,
    "cuda_graph_max_bs": _to_int,
    "tp_size": _to_int,
    "mamba_ssm_dtype": _to_str,
    "speculative_num_steps": _to_int,
    "speculative_eagle_topk": _to_int,
    "kv_cache_dtype": _to_str,
    "max_prefill_tokens": _to_int,
    "enable_spec_v2": _to_bool,
}


# --- flag resolution (server_args.py) ----------------------------------------------------


def speculative(flags: EngineFlags) -> bool:
    """Whether a speculative algorithm is configured."""
    return flags.speculative_algorithm is not None


def speculative_params(flags: EngineFlags) -> tuple[int, int, int]:
    """(steps, topk, draft tokens), as ``auto_choose_speculative_params`` resolves them.

    Defaults are (3, 1, 4) for most architectures; ``topk == 1`` forces ``draft = steps + 1``.
    """
    draft = flags.speculative_num_draft_tokens
    steps = flags.speculative_num_steps or (draft - 1 if draft else 3)
    topk = flags.speculative_eagle_topk or 1
    if topk == 1:
        return steps, topk, steps + 1
    return steps, topk, draft or 4


def num_draft_tokens(flags: EngineFlags) -> int:
    """Draft tokens verified per step (0 without speculative decoding)."""
    return speculative_params(flags)[2] if speculative(flags) else 0


def cli_max_running_requests(flags: EngineFlags) -> int | None:
    """Pre-cap value: the CLI one, or 48 with speculative decoding (server_args.py)."""
    if flags.max_running_requests is None and speculative(flags):
        return SPECULATIVE_DEFAULT_MAX_RUNNING
    return flags.max_running_requests


def resolved_mamba_strategy(flags: EngineFlags) -> str:
    """``auto`` resolves to ``no_buffer`` (server_args.py, mamba scheduler strategy handling)."""
    strategy = flags.mamba_scheduler_strategy
    return "no_buffer" if strategy == "auto" else strategy


def check_hybrid_flags(flags: EngineFlags) -> None:
    """Raise the ValueErrors ``ServerArgs`` raises for hybrid (Mamba) models.

    Speculative decoding + radix cache + ``no_buffer``, and ``extra_buffer`` without the radix
    cache (it keeps ping-pong slots for radix-tree tracking; ``server_args.py`` mamba scheduler
    strategy checks, 0.5.10.post1/0.5.11). The conditions are SGLang's; the messages are the
    sim's own wording.
    """
    if flags.mamba_scheduler_strategy == "extra_buffer" and flags.disable_radix_cache:
        raise ValueError(
            "--mamba-scheduler-strategy extra_buffer requires the radix cache; it cannot be "
            "used with --disable-radix-cache."
        )
    if (
        speculative(flags)
        and not flags.disable_radix_cache
        and resolved_mamba_strategy(flags) == "no_buffer"
    ):
        raise ValueError(
            "Speculative decoding for hybrid (Mamba) models with radix cache requires "
            "--mamba-scheduler-strategy extra_buffer (or --disable-radix-cache)."
        )


def overlap_schedule(flags: EngineFlags, hybrid: bool = True) -> bool:
    """Whether the overlap scheduler stays on (``server_args.py``
    ``disable_overlap_schedule`` rules; docs/capacity.md step 8)."""
    algo = flags.speculative_algorithm
    if flags.disable_overlap_schedule or algo in NO_OVERLAP_ALGORITHMS:
        return False
    if algo in EAGLE_FAMILY:
        topk = speculative_params(flags)[1]
        return flags.enable_spec_v2 and topk == 1
    # Radix cache + no_buffer (non-speculative) forces overlap off on hybrid models.
    no_buffer = resolved_mamba_strategy(flags) == "no_buffer"
    return not (hybrid and not flags.disable_radix_cache and no_buffer)


def mamba_ratio(flags: EngineFlags) -> int:
    """Mamba slots per running request (``model_runner_kv_cache_mixin.py::_calculate_mamba_ratio``).

    1 without radix cache, 3 with ``no_buffer``, 5 with ``extra_buffer`` and overlap on (two
    ping-pong slots), 4 with ``extra_buffer`` and overlap off.
    """
    if flags.disable_radix_cache:
        return 1
    if resolved_mamba_strategy(flags) != "extra_buffer":
        return 3
    return 5 if overlap_schedule(flags) else 4


def _gpu_memory_row(gpu_memory_mib: int, tp_size: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU memory (the table of
    ``server_args.py::_handle_gpu_memory_settings``; docs/capacity.md step 1)."""
    if gpu_memory_mib <= 0:
        return 4096, 160
    gib = gpu_memory_mib / MIB_PER_GIB
    rows = ((20, 2048, 8, 8), (35, 2048, 24, 80), (60, 4096, 32, 160), (160, 8192, 256, 512))
    for limit, chunk, graph_small_tp, graph_big_tp in rows:
        if gib < limit:
            return chunk, graph_small_tp if tp_size < 4 else graph_big_tp
    return 16384, 512


def reserved_mib(
    chunked_prefill_size: int, cuda_graph_max_bs: int, flags: EngineFlags, gpu_mib: int
) -> float:
    """Memory kept out of the static pool (``server_args.py::_handle_gpu_memory_settings``)."""
    reserved = 512 + max(chunked_prefill_size, 2048) * 1.5 + cuda_graph_max_bs * 2
    reserved += flags.tp_size / 8 * 1024  # tp * pp / 8 * 1024 with pp = 1
    if gpu_mib > 60 * MIB_PER_GIB:
        reserved = max(reserved, 10240)
    return reserved + SPECULATIVE_RESERVE_MIB.get(flags.speculative_algorithm or "", 0)


def derived_defaults(
    gpu_memory_mib: int, flags: EngineFlags, shape: ModelShape | None = None
) -> tuple[int, int, float]:
    """(chunked_prefill_size, cuda_graph_max_bs, mem_fraction_static), as derived by SGLang.

    Mirrors ``srt/server_args.py::_handle_gpu_memory_settings``.

    Explicit flags win. The VLM factor applies only when ``shape`` is given and the fraction is
    derived (not set on the command line).
    """
    chunk_default, graph_default = _gpu_memory_row(gpu_memory_mib, flags.tp_size)
    chunk = flags.chunked_prefill_size or chunk_default
    graph_bs = flags.cuda_graph_max_bs or graph_default
    if flags.mem_fraction_static is not None:
        return chunk, graph_bs, flags.mem_fraction_static
    if gpu_memory_mib <= 0:
        fraction = 0.88
    else:
        reserved = reserved_mib(chunk, graph_bs, flags, gpu_memory_mib)
        fraction = round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)
    if shape is not None:
        fraction *= vlm_mem_factor(shape.vision)
    return chunk, graph_bs, fraction


# --- pool sizing (model_runner_kv_cache_mixin.py) ------------------------------------------


def ssm_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """SSM state of one slot per GPU, honouring ``--mamba-ssm-dtype`` (bf16 halves fp32)."""
    ssm = shape.mamba_bytes_per_slot - shape.mamba_conv_bytes_per_slot
    dtype = flags.mamba_ssm_dtype or shape.mamba_ssm_dtype
    scale = DTYPE_BYTES.get(dtype, 4) / DTYPE_BYTES.get(shape.mamba_ssm_dtype, 4)
    return ssm * scale / flags.tp_size


def conv_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """Conv state of one slot per GPU."""
    return shape.mamba_conv_bytes_per_slot / flags.tp_size


def mamba_bytes_per_slot(shape: ModelShape, flags: EngineFlags) -> float:
    """``per_req`` of ``handle_max_mamba_cache``: conv + SSM state of one slot per GPU."""
    return ssm_bytes_per_slot(shape, flags) + conv_bytes_per_slot(shape, flags)


def kv_cell_bytes(shape: ModelShape, flags: EngineFlags) -> float:
    """KV bytes per token per GPU (``--kv-cache-dtype`` fp8 halves it)."""
    return shape.kv_bytes_per_token * KV_DTYPE_SCALE.get(flags.kv_cache_dtype, 1.0) / flags.tp_size


def handle_max_mamba_cache(
    rest_gib: float, per_slot: float, flags: EngineFlags, cli_cap: int | None
) -> tuple[float, int]:
    """Reserve speculative states and Mamba slots; return (GiB left for KV, slot count).

    Mirrors ``model_runner_kv_cache_mixin.py::handle_max_mamba_cache`` (0.5.10 and 0.5.11 alike).
    """
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


def resolve_max_num_reqs(
    max_total_tokens: int, context_len: int, cli_cap: int | None, slots: int, ratio: int | None
) -> int:
    """Effective running cap (``model_runner_kv_cache_mixin.py::_resolve_max_num_reqs``)."""
    estimated = min(max(int(max_total_tokens / context_len * 512), 2048), 4096)
    if cli_cap is not None:
        cap = min(cli_cap, estimated)
    else:
        cap = min(estimated, max_total_tokens // 2)
    if ratio is not None:
        cap = min(cap, slots // ratio)
    return cap


@dataclass(frozen=True)
class CapacityPlan:
    """What SGLang would allocate and the caps its scheduler would apply."""

    max_running_requests: int  # effective cap the scheduler applies
    cli_max_running_requests: int | None  # /server_info top level: CLI value, or 48 with spec
    max_total_num_tokens: int
    max_mamba_cache_size: int
    mamba_ratio: int
    mem_fraction_static: float
    context_len: int
    max_req_len: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    # keys: total, weights, mamba, mamba_intermediate, kv, reserved, free (they sum to total).
    # "free" is pool memory nothing allocates: mostly the speculative reservation made for the
    # pre-cap max_running_requests but allocated only for the final cap (handle_max_mamba_cache).
    memory_gib: dict[str, float]
    max_req_input_len: int = 0
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    overlap_schedule: bool = True
    num_draft_tokens: int = 0
    # Graph memory: SGLang's own allowance in the reserve formula, bs * 2 MiB (not measured).
    cuda_graph_gib: float = 0.0


def _kv_tokens(rest_gib: float, shape: ModelShape, flags: EngineFlags) -> int:
    """``profile_max_num_token`` step 3: KV tokens from the rest, capped by --max-total-tokens."""
    tokens = int(rest_gib * GIB) // int(kv_cell_bytes(shape, flags))
    if flags.max_total_tokens is not None:
        tokens = min(tokens, flags.max_total_tokens)
    if tokens <= 0:
        raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
    return tokens


def _memory_map(
    shape: ModelShape,
    flags: EngineFlags,
    total_gib: float,
    pool_gib: float,
    sizes: tuple[int, int, int],
) -> dict[str, float]:
    """Split the GPU into weights, Mamba, intermediate, KV, reserved and free GiB."""
    slots, cap, tokens = sizes
    weights = shape.weights_gib / flags.tp_size
    per_slot = mamba_bytes_per_slot(shape, flags) if shape.hybrid else 0.0
    mamba = (slots + 1) * per_slot / GIB if shape.hybrid else 0.0  # MambaPool holds slots + 1
    inter = (cap + 1) * num_draft_tokens(flags) * per_slot / GIB if shape.hybrid else 0.0
    kv = tokens * kv_cell_bytes(shape, flags) / GIB
    unexplained = shape.unexplained_gib / flags.tp_size
    draft = draft_gib(shape, flags, tokens)
    free = max(0.0, pool_gib - weights - mamba - inter - kv - unexplained)
    used = weights + mamba + inter + kv + unexplained + draft + free
    return {
        "total": total_gib,
        "weights": weights,
        "mamba": mamba,
        "mamba_intermediate": inter,
        "kv": kv,
        "unexplained": unexplained,
        "draft": draft,  # draft weights + draft KV, taken from the reserve
        "reserved": total_gib - used,
        "free": free,
    }


def draft_gib(shape: ModelShape, flags: EngineFlags, tokens: int) -> float:
    """GiB the speculative draft worker takes after the target's pools: its weights and its own
    KV pool of ``tokens`` (out of the reserve that mem_fraction_static leaves)."""
    if not speculative(flags):
        return 0.0
    kv = tokens * shape.draft_kv_bytes_per_token * KV_DTYPE_SCALE.get(flags.kv_cache_dtype, 1.0)
    return (shape.draft_weights_gib + kv / GIB) / flags.tp_size


def plan_capacity(shape: ModelShape, flags: EngineFlags, gpu_memory_mib: int) -> CapacityPlan:
    """Size the pools and the running cap as SGLang would (``_resolve_memory_pool_config``)."""
    if shape.hybrid:
        check_hybrid_flags(flags)
    chunk, graph_bs, fraction = derived_defaults(gpu_memory_mib, flags, shape)
    total_gib = gpu_memory_mib / MIB_PER_GIB
    pool_gib = total_gib * fraction
    # post - pre * (1 - mem_fraction_static), post measured after the TARGET's weights only: the
    # draft worker is created later (scheduler.py::init_tp_model_worker, then the draft).
    rest = pool_gib - (shape.weights_gib + shape.unexplained_gib) / flags.tp_size
    cli_cap = cli_max_running_requests(flags)
    slots, ratio = 0, None
    if shape.hybrid:
        per_slot = mamba_bytes_per_slot(shape, flags)
        rest, slots = handle_max_mamba_cache(rest, per_slot, flags, cli_cap)
        ratio = mamba_ratio(flags)
        if slots <= 0:
            raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
    tokens = _kv_tokens(rest, shape, flags)
    context_len = flags.context_length or shape.context_length
    cap = resolve_max_num_reqs(tokens, context_len, cli_cap, slots, ratio)
    if cap <= 0:
        raise RuntimeError(f"max_running_requests resolves to {cap} (Mamba slots {slots} < R).")
    max_req_len = min(context_len - 1, tokens - 1)
    return CapacityPlan(
        max_running_requests=cap,
        cli_max_running_requests=cli_cap,
        max_total_num_tokens=tokens,
        max_mamba_cache_size=slots,
        mamba_ratio=ratio or 0,
        mem_fraction_static=fraction,
        context_len=context_len,
        max_req_len=max_req_len,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=graph_bs,
        memory_gib=_memory_map(shape, flags, total_gib, pool_gib, (slots, cap, tokens)),
        max_req_input_len=max_req_len - 5,
        max_prefill_tokens=flags.max_prefill_tokens,
        overlap_schedule=overlap_schedule(flags, shape.hybrid),
        num_draft_tokens=num_draft_tokens(flags),
        cuda_graph_gib=graph_bs * 2 / MIB_PER_GIB,
    )


def mamba_breakdown_gib(
    shape: ModelShape, flags: EngineFlags, plan: CapacityPlan
) -> dict[str, float]:
    """GiB of each MambaPool buffer, as the ``Mamba Cache is allocated`` log line reports them."""
    states = plan.max_mamba_cache_size + 1
    inter = (plan.max_running_requests + 1) * plan.num_draft_tokens
    conv, ssm = conv_bytes_per_slot(shape, flags), ssm_bytes_per_slot(shape, flags)
    return {
        "conv_state": states * conv / GIB,
        "ssm_state": states * ssm / GIB,
        "intermediate_ssm_state_cache": inter * ssm / GIB,
        "intermediate_conv_window_cache": inter * conv / GIB,
    }


# --- admission and retraction (managers/schedule_policy.py, managers/scheduler.py) ---------

# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: the most output tokens one request is budgeted for.
CLIP_MAX_NEW_TOKENS = 4096
# global_config / environ defaults: init ratio 0.7 x --schedule-conservativeness, decaying to
# 0.14 of it over 600 decode steps; after a retraction the ratio is re-estimated with
# RETRACT_DECODE_STEPS more steps per running request.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


@dataclass
class NewTokenRatio:
    """``Scheduler.new_token_ratio``: the share of a request's remaining output budget that
    admission reserves in the KV pool (SGLang admits optimistically and retracts when short)."""

    init: float
    floor: float
    decay: float
    value: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float = 1.0) -> NewTokenRatio:
        """The scheduler's start values for ``--schedule-conservativeness``."""
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        floor = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS, init)

    def decode_steps(self, steps: int) -> None:
        """Decay after ``steps`` decode batches without a retraction."""
        self.value = max(self.value - self.decay * steps, self.floor)

    def after_retract(self, decoded: int, max_new_total: int, running: int) -> None:
        """``ScheduleBatch.retract_decode``'s new estimate, capped at 1."""
        estimate = (decoded + RETRACT_DECODE_STEPS * running) / max(max_new_total, 1)
        self.value = min(1.0, estimate)


def admission_tokens(prefill_tokens: int, remaining_output: int, ratio: float) -> float:
    """KV tokens ``PrefillAdder`` budgets for one request: the prefill plus its remaining
    output budget (clipped to CLIP_MAX_NEW_TOKENS) times the new-token ratio."""
    return prefill_tokens + min(max(0, remaining_output), CLIP_MAX_NEW_TOKENS) * ratio


def steady_kv_per_request(input_tokens: float, output_tokens: float) -> float:
    """KV tokens a running request holds on average over its life: its prompt and, decoding
    at a steady pace, half its output. What the pool must hold per running request so that
    optimistic admission does not keep retracting."""
    return input_tokens + output_tokens / 2
