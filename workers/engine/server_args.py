"""SGLang's launch flags that decide capacity, and how ``ServerArgs`` resolves them.

Each function names the ``srt/server_args.py`` code it mirrors: the memory reserve and
``mem_fraction_static`` (``_handle_gpu_memory_settings``, ``adjust_mem_fraction_for_vlm``), the
piecewise CUDA graph switch (``_handle_piecewise_cuda_graph``), the speculative defaults
(``_handle_speculative_decoding``) and the Mamba scheduler rules (``_handle_mamba_radix_cache``).
Written from 0.5.11; where a later release resolves a flag differently the branch reads that
release's trait (:func:`release`, :mod:`workers.engine.releases`) and names where it was read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING

from workers.engine.releases import OLDEST, Traits, status, traits

if TYPE_CHECKING:
    from workers.engine.model_config import ModelShape

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
# The release planned when nothing says which one runs (the one checked on a real H200).
DEFAULT_SGLANG_VERSION = "0.5.11"
# Architectures whose ``auto`` Mamba strategy may become extra_buffer from 0.5.14 (with the
# default triton linear-attention backend): server_args.py::_support_mamba_cache_extra_buffer.
EXTRA_BUFFER_ARCHITECTURES = frozenset({
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM", "InternS2PreviewForConditionalGeneration",
    "MiniCPMV4_6ForConditionalGeneration", "BailingMoeV2_5ForCausalLM", "FalconH1ForCausalLM",
    "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
})


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
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def _to_str(value: object) -> str:
    return str(value)


# Names later releases give these flags (0.5.14 server_args.py::add_cli_args; the old ones gone
# in 0.5.20, releases.RENAMED_0_5_20).
FLAG_ALIASES = {"tensor_parallel_size": "tp_size", "tp": "tp_size",
                "mamba_radix_cache_strategy": "mamba_scheduler_strategy",
                "cuda_graph_max_bs_decode": "cuda_graph_max_bs"}


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
    page_size: int = 1
    disable_piecewise_cuda_graph: bool = False
    enforce_piecewise_cuda_graph: bool = False
    enable_torch_compile: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    # The SGLang release whose arithmetic applies (releases.KNOWN, or a newer build).
    sglang_version: str = DEFAULT_SGLANG_VERSION
    # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1 (read from 0.5.17; environ.py, default off).
    mamba_skip_decode_lock: bool = False
    # --attention-backend / --prefill-attention-backend / --decode-attention-backend (None:
    # SGLang picks one; only the refusal rules read them).
    attention_backend: str | None = None
    # SGLANG_MAMBA_CONV_DTYPE (configs/mamba_utils.py::mamba2_state_dtype; bfloat16 default).
    mamba_conv_dtype: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None

    @classmethod
    def from_flags(
        cls,
        flags: Mapping[str, object],
        env: Mapping[str, str] | None = None,
        spec_v2_default: bool | None = None,
        version: str | None = None,
    ) -> EngineFlags:
        """Build from flag names (dashes or underscores, leading dashes ok); others are ignored.

        ``version`` is the SGLang release planned (None: :data:`DEFAULT_SGLANG_VERSION`);
        ``spec_v2_default`` overrides its default of ``SGLANG_ENABLE_SPEC_V2``. The environment
        variable overrides both where the release reads it (through 0.5.13), and
        ``SGLANG_MAMBA_SSM_DTYPE`` stands for ``--mamba-ssm-dtype`` (``mamba_utils.py``).
        """
        known = {f.name: _CONVERTERS[f.name] for f in fields(cls)}
        values: dict[str, object] = {}
        for raw_key, raw_value in flags.items():
            key = raw_key.lstrip("-").replace("-", "_")
            key = FLAG_ALIASES.get(key, key)
            if key in known and raw_value is not None:
                values[key] = known[key](raw_value)
        if version is not None:
            values["sglang_version"] = version
        found = _release(str(values.get("sglang_version", DEFAULT_SGLANG_VERSION)))
        values.setdefault("enable_spec_v2", found.spec_v2_default)
        if spec_v2_default is not None:
            values["enable_spec_v2"] = spec_v2_default
        if found.spec_v2_env and env is not None and "SGLANG_ENABLE_SPEC_V2" in env:
            values["enable_spec_v2"] = _to_bool(env["SGLANG_ENABLE_SPEC_V2"])
        if not found.spec_v2_env:
            # 0.5.14 arg_groups/speculative_hook.py: the V2 worker always, the variable unread.
            values["enable_spec_v2"] = True
        if found.skip_decode_lock_env and env is not None:
            values["mamba_skip_decode_lock"] = _to_bool(
                env.get("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK", "0"))
        ssm_env = (env or {}).get("SGLANG_MAMBA_SSM_DTYPE")
        if ssm_env and "mamba_ssm_dtype" not in values:
            values["mamba_ssm_dtype"] = ssm_env
        conv_env = (env or {}).get("SGLANG_MAMBA_CONV_DTYPE")
        if conv_env:
            values["mamba_conv_dtype"] = conv_env
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
    "page_size": _to_int,
    "disable_piecewise_cuda_graph": _to_bool,
    "enforce_piecewise_cuda_graph": _to_bool,
    "enable_torch_compile": _to_bool,
    "piecewise_cuda_graph_max_tokens": _to_int,
    "sglang_version": _to_str,
    "mamba_skip_decode_lock": _to_bool,
    "attention_backend": _to_str,
    "mamba_conv_dtype": _to_str,
    "prefill_attention_backend": _to_str,
    "decode_attention_backend": _to_str,
}


@lru_cache(maxsize=64)
def _release(version: str) -> Traits:
    """The traits of ``version``; an older or unparsable one plans as the oldest known."""
    return traits(version) if status(version) not in ("older", "invalid") else traits(OLDEST)


def release(flags: EngineFlags) -> Traits:
    """The pool-arithmetic traits of the release ``flags`` are planned for."""
    return _release(flags.sglang_version)


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


def resolved_mamba_strategy(flags: EngineFlags, architecture: str | None = None) -> str:
    """What ``auto`` resolves to on a hybrid model (``_handle_mamba_radix_cache``).

    Through 0.5.13 ``no_buffer``. From 0.5.14 (``server_args.py::_handle_mamba_radix_cache``;
    ``arg_groups/overrides.py`` from 0.5.17) ``extra_buffer`` when the overlap scheduler is
    wanted or ``page_size > 1`` and the architecture supports it (``architecture`` None: one
    that does, as every hybrid :mod:`workers.engine.model_config` reads), else ``no_buffer``.
    """
    strategy = flags.mamba_scheduler_strategy
    if strategy != "auto":
        return strategy
    if release(flags).mamba_auto_strategy != "extra_buffer_if_overlap":
        return "no_buffer"
    # Before the speculative rules run (_handle_model_specific_adjustments comes first in
    # __post_init__), so only --disable-overlap-schedule itself counts, not NGRAM's switch.
    wants = not flags.disable_overlap_schedule or flags.page_size > 1
    supported = architecture is None or architecture in EXTRA_BUFFER_ARCHITECTURES
    return "extra_buffer" if wants and supported else "no_buffer"


def check_hybrid_flags(flags: EngineFlags) -> None:
    """Raise the ValueErrors ``ServerArgs._handle_mamba_radix_cache`` raises for hybrid models.

    ``extra_buffer`` with ``--disable-radix-cache``, and speculative decoding with the radix
    cache under ``no_buffer``. The conditions are SGLang's; the messages shortened.
    """
    # From 0.5.14 ``_handle_mamba_radix_cache`` returns first when the radix cache is off.
    early_return = release(flags).mamba_auto_strategy == "extra_buffer_if_overlap"
    buffered = flags.mamba_scheduler_strategy in ("extra_buffer", "extra_buffer_lazy")
    if buffered and flags.disable_radix_cache and not early_return:
        raise ValueError(
            "--mamba-scheduler-strategy extra_buffer requires the radix cache; it cannot be "
            "used with --disable-radix-cache (use no_buffer)."
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


# server_args.py::_handle_model_specific_adjustments: architectures whose branch calls
# _handle_mamba_radix_cache(support_mamba_cache_extra_buffer=False) through 0.5.13 (0.5.14 moves
# them into _support_mamba_cache_extra_buffer, EXTRA_BUFFER_ARCHITECTURES above).
NO_EXTRA_BUFFER_ARCHITECTURES = frozenset({
    "FalconH1ForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
    "JetNemotronForCausalLM", "JetVLMForConditionalGeneration", "Lfm2ForCausalLM",
})
# The same method asserts the attention backend is not triton for these (0.5.11: "does not
# support triton attention backend, as the first layer might not be an attention layer").
NO_TRITON_ARCHITECTURES = frozenset({"NemotronHForCausalLM", "Lfm2ForCausalLM"})
# The GptOssForCausalLM branch asserts prefill and decode backends are among these.
GPT_OSS_BACKENDS = frozenset({"triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_xpu",
                              "aiter"})


@dataclass(frozen=True)
class Refusal:
    """A launch SGLang rejects by rule before it serves: its words (shortened) and where."""

    message: str
    source: str  # the SGLang 0.5.11 file and function that raise it

    def __str__(self) -> str:
        return f"{self.message} (SGLang {self.source})"


class LaunchRefused(ValueError):
    """SGLang would refuse this launch (see :func:`known_refusals`)."""


def known_refusals(shape: ModelShape, flags: EngineFlags) -> list[Refusal]:
    """The rules by which SGLang 0.5.11 refuses ``flags`` for ``shape`` at start, each cited.

    Besides :func:`check_hybrid_flags` (``_handle_mamba_radix_cache``'s ValueErrors):

    - Nemotron-H (and LFM2) on ``--attention-backend triton``: an assertion in
      ``ServerArgs._handle_model_specific_adjustments`` (the ``NemotronHForCausalLM`` branch);
    - ``--mamba-scheduler-strategy extra_buffer`` on a hybrid whose branch passes
      ``support_mamba_cache_extra_buffer=False`` (Falcon-H1, Nemotron-H, Granite-4.0-H, JetNemotron,
      LFM2): the assertion at the top of ``_handle_mamba_radix_cache``, through 0.5.13;
    - gpt-oss on a prefill or decode backend outside its list (the ``GptOssForCausalLM`` branch);
    - ``--tp-size`` that does not divide the attention heads (``layers/linear.py::
      QKVParallelLinear``, ``divide``) or the Mamba heads (``configs/mamba_utils.py::
      Mamba2StateShape.create``, ``divide``), or KV heads and TP that divide neither way.
    """
    out: list[Refusal] = []
    arch = shape.architecture
    backend = flags.attention_backend
    if arch in NO_TRITON_ARCHITECTURES and backend == "triton":
        out.append(Refusal(f"{arch} does not support triton attention backend, as the first "
                           "layer might not be an attention layer",
                           "server_args.py::ServerArgs._handle_model_specific_adjustments"))
    early_return = release(flags).mamba_auto_strategy == "extra_buffer_if_overlap"
    if (arch in NO_EXTRA_BUFFER_ARCHITECTURES and shape.hybrid and not early_return
            and flags.mamba_scheduler_strategy == "extra_buffer"):
        out.append(Refusal(f"mamba extra_buffer is not supported for {arch} model "
                           "(use --mamba-scheduler-strategy no_buffer or auto)",
                           "server_args.py::ServerArgs._handle_mamba_radix_cache"))
    if arch == "GptOssForCausalLM":
        chosen = {flags.prefill_attention_backend or backend,
                  flags.decode_attention_backend or backend} - {None}
        bad = sorted(b for b in chosen if b not in GPT_OSS_BACKENDS)  # type: ignore[misc]
        if bad:
            out.append(Refusal(f"GptOssForCausalLM requires one of {sorted(GPT_OSS_BACKENDS)} "
                               f"attention backend, but got {', '.join(bad)}",
                               "server_args.py::ServerArgs._handle_model_specific_adjustments"))
    tp = flags.tp_size
    heads = shape.attention_heads
    if tp > 1 and heads and heads % tp:
        out.append(Refusal(f"{heads} attention heads are not divisible by --tp-size {tp}",
                           "layers/linear.py::QKVParallelLinear (divide)"))
    kv = shape.kv_heads
    if tp > 1 and kv and kv % tp and tp % kv:
        out.append(Refusal(f"{kv} KV heads and --tp-size {tp}: neither divides the other",
                           "layers/linear.py::QKVParallelLinear (divide)"))
    if tp > 1 and shape.mamba_heads and shape.mamba_heads % tp:
        out.append(Refusal(f"{shape.mamba_heads} Mamba heads are not divisible by --tp-size {tp}",
                           "configs/mamba_utils.py::Mamba2StateShape.create (divide)"))
    return out


def check_launch(shape: ModelShape, flags: EngineFlags) -> None:
    """Raise :class:`LaunchRefused` naming every rule of :func:`known_refusals` that applies."""
    found = known_refusals(shape, flags)
    if found:
        raise LaunchRefused("SGLang refuses this launch: " + "; ".join(map(str, found)))


def overlap_schedule(flags: EngineFlags, hybrid: bool = True) -> bool:
    """Whether the overlap scheduler stays on (``server_args.py``
    ``disable_overlap_schedule`` rules; docs/capacity.md step 8)."""
    algo = flags.speculative_algorithm
    if flags.disable_overlap_schedule or algo in NO_OVERLAP_ALGORITHMS:
        return False
    if algo in EAGLE_FAMILY:
        topk = speculative_params(flags)[1]
        return (flags.enable_spec_v2 or not release(flags).spec_v2_env) and topk == 1
    # Radix cache + no_buffer (non-speculative) forces overlap off on hybrid models.
    no_buffer = resolved_mamba_strategy(flags) == "no_buffer"
    return not (hybrid and not flags.disable_radix_cache and no_buffer)


def mamba_ratio(flags: EngineFlags) -> int:
    """Mamba slots per running request (``model_runner_kv_cache_mixin.py::_calculate_mamba_ratio``,
    ``mem_cache/kv_cache_configurator.py`` from 0.5.16).

    1 without radix cache, 3 with ``no_buffer``, 5 with ``extra_buffer`` and overlap on (two
    ping-pong slots), 4 with ``extra_buffer`` and overlap off. From 0.5.13 ``extra_buffer_lazy``
    keeps one ping-pong slot (4; ``MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY``). From 0.5.17
    ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK`` drops the base 3 by one (``no_buffer`` adds it back).
    """
    if flags.disable_radix_cache:
        return 1
    found = release(flags)
    skip = found.skip_decode_lock_env and flags.mamba_skip_decode_lock
    base = 3 - (1 if skip else 0)
    strategy = resolved_mamba_strategy(flags)
    if strategy == "extra_buffer_lazy" and found.lazy_extra_buffer:
        return base + 1
    if strategy not in ("extra_buffer", "extra_buffer_lazy"):
        return base + (1 if skip else 0)
    return base + (2 if overlap_schedule(flags) else 1)


def vlm_mem_factor(vision: tuple[int, int] | None) -> float:
    """``ServerArgs.adjust_mem_fraction_for_vlm``: ``0.95 * clamp(1 - 0.1 * (layers * hidden^2
    / (24 * 1024^2) - 1), 0.8, 1.05)``, the ViT's weight count against a ViT-L/14."""
    if vision is None:
        return 1.0
    layers, hidden = vision
    ratio = layers * hidden**2 / (24 * 1024**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


def _gpu_memory_row(
    gpu_memory_mib: int, tp_size: int, small: tuple[int, int, int] = (2048, 24, 80)
) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU memory (the table of
    ``server_args.py::_handle_gpu_memory_settings``; docs/capacity.md step 1). ``small`` is the
    release's 20-35 GiB row (0.5.20 ``arg_groups/memory_hook.py``: 4096, 48, 160)."""
    if gpu_memory_mib <= 0:
        return 4096, 160
    gib = gpu_memory_mib / MIB_PER_GIB
    rows = ((20, 2048, 8, 8), (35, *small), (60, 4096, 32, 160), (160, 8192, 256, 512))
    for limit, chunk, graph_small_tp, graph_big_tp in rows:
        if gib < limit:
            return chunk, graph_small_tp if tp_size < 4 else graph_big_tp
    return 16384, 512


def piecewise_cuda_graph(flags: EngineFlags, shape: ModelShape | None) -> bool:
    """Whether piecewise CUDA graphs stay on (``_handle_piecewise_cuda_graph``: off for the
    listed architectures, multimodal models and torch.compile; ``--enforce-…`` wins)."""
    if flags.enforce_piecewise_cuda_graph:
        return True
    if flags.disable_piecewise_cuda_graph or flags.enable_torch_compile:
        return False
    return shape is None or not (shape.piecewise_cuda_graph_disabled or shape.multimodal)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """``_generate_piecewise_cuda_graph_tokens``: the prefill sizes captured up to max_tokens."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return [s for s in sizes if s <= max_tokens]


def reserved_mib(
    chunked_prefill_size: int,
    cuda_graph_max_bs: int,
    flags: EngineFlags,
    gpu_mib: int,
    shape: ModelShape | None = None,
) -> float:
    """Memory kept out of the static pool (``server_args.py::_handle_gpu_memory_settings``)."""
    prefill = chunked_prefill_size if chunked_prefill_size > 0 else flags.max_prefill_tokens
    reserved = 512 + max(prefill, 2048) * 1.5 + cuda_graph_max_bs * 2
    reserved += flags.tp_size / 8 * 1024  # tp * pp / 8 * 1024 with pp = 1
    if piecewise_cuda_graph(flags, shape):
        max_tokens = flags.piecewise_cuda_graph_max_tokens or chunked_prefill_size
        if flags.max_total_tokens is not None:
            max_tokens = min(max_tokens, flags.max_total_tokens)
        reserved += len(piecewise_token_sizes(max_tokens)) * 8
    if gpu_mib > 60 * MIB_PER_GIB:
        reserved = max(reserved, 10240)
    if not release(flags).mem_fraction_spec_reserve_mib:
        return reserved  # 0.5.14 _handle_gpu_memory_settings: no draft reserve
    return reserved + SPECULATIVE_RESERVE_MIB.get(flags.speculative_algorithm or "", 0)


def derived_defaults(
    gpu_memory_mib: int, flags: EngineFlags, shape: ModelShape | None = None
) -> tuple[int, int, float]:
    """(chunked_prefill_size, cuda_graph_max_bs, mem_fraction_static), as derived by SGLang.

    Explicit flags win. The VLM factor applies when the fraction is derived and the model is
    one of SGLang's multimodal architectures with a ``vision_config``.
    """
    small = release(flags).small_gpu_defaults
    chunk_default, graph_default = _gpu_memory_row(gpu_memory_mib, flags.tp_size, small)
    chunk = flags.chunked_prefill_size or chunk_default
    graph_bs = flags.cuda_graph_max_bs or graph_default
    if flags.mem_fraction_static is not None:
        return chunk, graph_bs, flags.mem_fraction_static
    if gpu_memory_mib <= 0:
        fraction = 0.88
    else:
        reserved = reserved_mib(chunk, graph_bs, flags, gpu_memory_mib, shape)
        fraction = round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)
    if shape is not None and shape.multimodal:
        fraction *= vlm_mem_factor(shape.vision)
    return chunk, graph_bs, fraction
