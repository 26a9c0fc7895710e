"""The SGLang launch flags that decide capacity, with SGLang's defaults, parsed from a
command line or a launch profile (dashes or underscores, SGLang's value types). How
``ServerArgs`` resolves them is :mod:`workers.engine.server_args`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache

from workers.engine.releases import OLDEST, Traits, status, traits

# Prefill budget of one batch (--max-prefill-tokens default, server_args.py).
DEFAULT_MAX_PREFILL_TOKENS = 16384
# The release planned when nothing says which one runs (the one checked on a real H200).
DEFAULT_SGLANG_VERSION = "0.5.11"
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
    # --disable-cuda-graph: no decode graphs (and, from 0.5.17, no prefill graphs either).
    disable_cuda_graph: bool = False
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
    # --mm-feature-transport (0.5.17; None: cuda_ipc on one node, mem_reserve.tokenizer_gpu_mib).
    mm_feature_transport: str | None = None

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
        found = release_traits(str(values.get("sglang_version", DEFAULT_SGLANG_VERSION)))
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
    "disable_cuda_graph": _to_bool,
    "enforce_piecewise_cuda_graph": _to_bool,
    "enable_torch_compile": _to_bool,
    "piecewise_cuda_graph_max_tokens": _to_int,
    "sglang_version": _to_str,
    "mamba_skip_decode_lock": _to_bool,
    "attention_backend": _to_str,
    "mamba_conv_dtype": _to_str,
    "prefill_attention_backend": _to_str,
    "decode_attention_backend": _to_str,
    "mm_feature_transport": _to_str,
}


@lru_cache(maxsize=64)
def release_traits(version: str) -> Traits:
    """The traits of ``version``; an older or unparsable one plans as the oldest known."""
    return traits(version) if status(version) not in ("older", "invalid") else traits(OLDEST)
