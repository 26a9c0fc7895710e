"""The shape of a model, read from its own config.json: what SGLang's pool arithmetic needs.

A profile's ``model-path`` is a local folder (or its config.json), or a hub id. A hub id is
looked up in the local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
``~/.cache/huggingface/hub``: ``models--org--name/snapshots/<rev>/config.json``), then in the
fleet's own ``config/models/`` (``org--name/config.json`` for the models the shipped profiles
name; a path that is not on this machine, as in a snapshot from another node, by its folder
name). The network is never used. A config that cannot be found or read raises
:class:`ModelConfigError` with one line naming the file and the key.

What is derived follows SGLang 0.5.11's ``configs/model_config.py`` (``_derive_model_shapes``,
``get_total_num_kv_heads``, ``get_context_length``, the multimodal and piecewise-CUDA-graph
architecture lists), ``configs/qwen3_next.py`` (``layers_block_type``: every
``full_attention_interval``-th layer is full attention; Qwen3.5's text config inherits it),
``configs/mamba_utils.py`` (``Mamba2StateShape.create``, ``mamba_cache_per_req``,
``mamba2_state_dtype``), the Mamba-2 hybrids' configs (``configs/falcon_h1.py``,
``configs/nemotron_h.py``, ``configs/granitemoehybrid.py``: their layer ids and
``mamba2_cache_params``; ``model_executor/model_runner.py::mamba2_config`` says which
architectures get a Mamba pool) and
``model_executor/pool_configurator.py`` (the KV cell: ``kv_heads * (head_dim + v_head_dim) *
layers * dtype``, MLA ``(kv_lora_rank + qk_rope_head_dim) * layers * dtype``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from workers.engine import weights as w
from workers.engine.mamba2 import mamba2_params

GIB = 1024**3
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "config" / "models"
# Where hub ids and foreign paths are looked up after the HF cache (tests add fixture folders).
CONFIG_DIRS: list[Path] = [REPO_CONFIGS]

# configs/model_config.py::multimodal_model_archs (the ones with a text decoder we size).
MULTIMODAL_ARCHS = frozenset({
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration", "Llama4ForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration",
})
# configs/model_config.py::piecewise_cuda_graph_disabled_model_archs.
PIECEWISE_DISABLED_ARCHS = frozenset({
    "DeepseekV32ForCausalLM", "Qwen3NextForCausalLM", "GlmMoeDsaForCausalLM",
    "BailingMoeV2_5ForCausalLM", "LLaDAModelLM",
})
# configs/model_config.py::is_hybrid_swa_model (a separate sliding-window KV pool).
HYBRID_SWA_ARCHS = frozenset({"GptOssForCausalLM", "Llama4ForConditionalGeneration"})
# configs/model_config.py::_derive_model_shapes, the MLA branch.
MLA_ARCHS = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM",
})
# Classes with ``get_model_config_for_expert_location``: SGLang builds their expert-location
# metadata on the GPU before the weights load (eplb/expert_location.py).
EXPERT_LOCATION_ARCHS = frozenset({
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
})
HYBRID_LINEAR_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
# model_executor/model_runner.py::mamba2_config: the Mamba-2 hybrids whose config SGLang sizes a
# Mamba pool from (GraniteMoeHybrid only when one of its layer_types is "mamba").
MAMBA2_ARCHS = frozenset({"FalconH1ForCausalLM", "NemotronHForCausalLM",
                          "GraniteMoeHybridForCausalLM"})
# configs/nemotron_h.py::_pattern_to_list: one character per layer of hybrid_override_pattern.
NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# Kinds of decoder layer that hold a KV cache / a Mamba state slot.
KV_KINDS = frozenset({"attention", "parallel"})
STATE_KINDS = frozenset({"linear", "mamba", "parallel"})
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


class ModelConfigError(ValueError):
    """The model's config.json cannot be found or lacks a key the arithmetic needs."""


@dataclass(frozen=True)
class ModelShape:
    """What a model costs in GPU memory (whole model, tp=1), derived from its config.json."""

    name: str
    weights_gib: float
    draft_weights_gib: float  # the MTP draft's weights that stay after it loads
    kv_bytes_per_token: int  # full-attention layers, at the model's dtype (kv "auto")
    mamba_bytes_per_slot: int  # conv + SSM state of one slot (0 for non-hybrid)
    hybrid: bool
    context_length: int
    mamba_conv_bytes_per_slot: int = 0
    mamba_ssm_dtype: str = "float32"
    # The vision tower as ServerArgs.adjust_mem_fraction_for_vlm reads it: vision_config's
    # (num_hidden_layers or 24, hidden_size or 1024); None for a text-only model.
    vision: tuple[int, int] | None = None
    draft_kv_bytes_per_token: int = 0  # the draft's one attention layer
    # Memory an observed engine's pools lacked that the arithmetic does not explain (fitted to a
    # live engine's log by workers.tune.memory_model only; 0 from a config).
    unexplained_gib: float = 0.0
    model_type: str = "generic"
    architecture: str = "GenericForCausalLM"
    eos_token_id: int = 0
    multimodal: bool = False  # in SGLang's multimodal_model_archs (VLM memory factor)
    piecewise_cuda_graph_disabled: bool = False
    dtype_bytes: int = 2  # element size of the weights' dtype (the KV cache's with "auto")
    kv_heads: int = 0  # total KV heads (0 for MLA: the latent is not split by TP)
    full_attention_layers: int = 0
    linear_attention_layers: int = 0
    swa_layers: int = 0
    swa_kv_bytes_per_token: int = 0
    mtp_layers: int = 0
    draft_load_gib: float = 0.0  # draft weights while it loads (its own embed and lm_head too)
    # GPU memory SGLang allocates after it measures ``pre`` and before the weights load.
    pre_load_gib: float = 0.0
    experts: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False
    source: str = ""  # the config.json read
    weights_source: str = ""  # "safetensors index" or "config"
    tensor_gib: float = 0.0  # the tensors' exact sum (weights_gib: the allocator's segments)
    # The Mamba state's shape (Mamba2StateShape.create): "gdn" or "mamba2", its intermediate
    # size, groups, state size and heads; TP replicates groups that do not divide it.
    mamba_kind: str = ""
    mamba_intermediate: int = 0
    mamba_groups: int = 0
    mamba_state_size: int = 0
    mamba_heads: int = 0
    attention_heads: int = 0  # num_attention_heads (the TP divisibility rule)


def _hf_cache_dirs(env: Mapping[str, str]) -> list[Path]:
    dirs = []
    if env.get("HF_HUB_CACHE"):
        dirs.append(Path(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        dirs.append(Path(env["HF_HOME"]) / "hub")
    dirs.append(Path(env.get("HOME", str(Path.home()))) / ".cache" / "huggingface" / "hub")
    return dirs


def _cached_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one holding a config.json."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        found = repo_dir / "snapshots" / ref.read_text().strip() / "config.json"
        if found.is_file():
            return found
    snaps = sorted((repo_dir / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def find_config(model_path: str, env: Mapping[str, str] | None = None) -> Path:
    """The config.json a ``model-path`` names (never the network); ModelConfigError if none."""
    env = os.environ if env is None else env
    local = Path(model_path).expanduser()
    if local.is_file() and local.name == "config.json":
        return local
    if local.is_dir():
        if (local / "config.json").is_file():
            return local / "config.json"
        raise ModelConfigError(f"{local / 'config.json'}: no such file (model-path is a folder)")
    repo = model_path.strip("/")
    for cache in _hf_cache_dirs(env):
        found = _cached_snapshot(cache / ("models--" + repo.replace("/", "--")))
        if found is not None:
            return found
    for folder in CONFIG_DIRS:
        for name in (repo.replace("/", "--"), repo.rsplit("/", 1)[-1]):
            if (folder / name / "config.json").is_file():
                return folder / name / "config.json"
    shipped = [str(folder / repo.replace("/", "--")) for folder in CONFIG_DIRS]
    raise ModelConfigError(
        f"{model_path}/config.json: not a local folder, not in the Hugging Face cache "
        f"({', '.join(str(d) for d in _hf_cache_dirs(env))}) and not shipped "
        f"({', '.join(shipped)}); download it or set model-path to the model's folder"
    )


def _need(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"{source}: key {key!r} missing")
    return cfg[key]


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """``get_hf_text_config``: the language model's sub-config of a multimodal config."""
    for key in ("thinker_config", "llm_config", "language_config", "text_config"):
        sub = cfg.get(key)
        if isinstance(sub, Mapping) and "hidden_size" in sub:
            return {**{k: cfg[k] for k in ("torch_dtype", "dtype") if k in cfg}, **sub}
    return cfg


def context_length(text: Mapping[str, Any]) -> int:
    """``get_context_length``: the first length key, times a rope factor unless llama3 or
    ``original_max_position_embeddings`` is given."""
    rope = text.get("rope_scaling") or {}
    factor = float(rope.get("factor", 1)) if isinstance(rope, Mapping) else 1.0
    if isinstance(rope, Mapping) and ("original_max_position_embeddings" in rope
                                      or rope.get("rope_type") == "llama3"):
        factor = 1.0
    for key in CONTEXT_LENGTH_KEYS:
        if text.get(key) is not None:
            return int(factor * text[key])
    return 2048


def _layer_kinds(text: Mapping[str, Any], arch: str, source: str) -> list[str]:
    """What each decoder layer holds: ``attention``, ``linear`` (Gated DeltaNet), ``mamba``,
    ``parallel`` (attention and Mamba-2 in one layer) or ``mlp`` / ``moe`` (neither).

    - Qwen3-Next / 3.5: full attention where ``(l + 1) % full_attention_interval == 0``
      (``configs/qwen3_next.py::layers_block_type``).
    - Falcon-H1: every layer both (``configs/falcon_h1.py``: ``full_attention_layer_ids`` and
      ``linear_layer_ids`` are all layers).
    - Nemotron-H: ``layers_block_type``, else ``hybrid_override_pattern`` (``M`` Mamba-2, ``*``
      attention, ``-`` MLP, ``E`` MoE), whose length is the layer count
      (``configs/nemotron_h.py``: ``_resolve_layers_block_type``, ``num_hidden_layers``).
    - Granite-4.0-H: ``layer_types`` (``mamba`` / ``attention``), by default attention where
      ``(l + 1) % 6 == 0`` (``configs/granitemoehybrid.py``).
    """
    if arch == "NemotronHForCausalLM":
        kinds = text.get("layers_block_type")
        if not kinds:
            pattern = str(_need(text, "hybrid_override_pattern", source))
            kinds = [NEMOTRON_PATTERN[c] for c in pattern if c in NEMOTRON_PATTERN]
        return [str(k) for k in kinds]
    layers = int(_need(text, "num_hidden_layers", source))
    if arch == "FalconH1ForCausalLM":
        return ["parallel"] * layers
    if arch == "GraniteMoeHybridForCausalLM":
        kinds = text.get("layer_types") or [
            "attention" if (i + 1) % 6 == 0 else "mamba" for i in range(layers)]
        return [str(k) for k in kinds]
    if text.get("model_type") not in HYBRID_LINEAR_TYPES:
        return ["attention"] * layers
    interval = int(_need(text, "full_attention_interval", source))
    return ["attention" if (i + 1) % interval == 0 else "linear" for i in range(layers)]


def _mamba_state(text: Mapping[str, Any], arch: str, source: str) -> dict:
    """The Mamba state of one layer at tp=1 (``Mamba2StateShape.create``): conv
    ``(intermediate + 2 x groups x state) x (kernel - 1)`` in bf16 (``SGLANG_MAMBA_CONV_DTYPE``),
    SSM ``heads x head_dim x state`` in the SSM dtype. Gated DeltaNet passes value heads x value
    dim as the intermediate size, key heads as groups and the key dim as the state
    (``configs/qwen3_next.py::mamba2_cache_params``)."""
    if arch in MAMBA2_ARCHS:
        m = mamba2_params(text, arch, int(_need(text, "hidden_size", source)))
        m["kind"] = "mamba2"
    else:
        k_heads = int(_need(text, "linear_num_key_heads", source))
        v_heads = int(_need(text, "linear_num_value_heads", source))
        v_dim = int(_need(text, "linear_value_head_dim", source))
        m = {"kind": "gdn", "intermediate": v_heads * v_dim, "groups": k_heads,
             "heads": v_heads, "head_dim": v_dim,
             "state": int(_need(text, "linear_key_head_dim", source)),
             "kernel": int(_need(text, "linear_conv_kernel_dim", source)),
             "ssm_dtype": str(text.get("mamba_ssm_dtype") or "float32")}
    m["conv"] = (m["intermediate"] + 2 * m["groups"] * m["state"]) * (m["kernel"] - 1) * 2
    m["ssm"] = m["heads"] * m["head_dim"] * m["state"] * w.DTYPE_BYTES.get(m["ssm_dtype"], 4)
    return m


def _kv_cell(text: Mapping[str, Any], arch: str, elem: int, source: str) -> tuple[int, int, int]:
    """(bytes per token per layer, total KV heads, head_dim) of the full-attention KV cache."""
    if arch in MLA_ARCHS:
        latent = int(_need(text, "kv_lora_rank", source)) + int(
            _need(text, "qk_rope_head_dim", source))
        return latent * elem, 0, 256
    heads = int(_need(text, "num_attention_heads", source))
    hidden = int(_need(text, "hidden_size", source))
    # NemotronHConfig takes head_dim (default 128), never attention_head_dim.
    fallback = 128 if arch == "NemotronHForCausalLM" else hidden // heads
    head_dim = int(text.get("head_dim") or fallback)
    v_head_dim = int(text.get("v_head_dim") or head_dim)
    kv_heads = 1 if text.get("multi_query") else int(text.get("num_key_value_heads") or heads)
    return kv_heads * (head_dim + v_head_dim) * elem, kv_heads, head_dim


def _swa_layers(text: Mapping[str, Any], arch: str) -> int:
    """Sliding-window layers SGLang gives their own pool (``get_hybrid_layer_ids``)."""
    if arch not in HYBRID_SWA_ARCHS:
        return 0
    if arch == "Llama4ForConditionalGeneration":
        return sum(1 for i in range(int(text["num_hidden_layers"])) if (i + 1) % 4 != 0)
    return sum(1 for t in text.get("layer_types") or [] if t == "sliding_attention")


def index_total(folder: Path) -> int | None:
    """The weights' ``total_size`` from ``model.safetensors.index.json`` (None without one)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{index}: {exc}") from exc
    return int(total) if total else None


def expert_location_bytes(text: Mapping[str, Any], arch: str) -> int:
    """``ExpertLocationMetadata.init_trivial`` / ``_init_raw`` (``eplb/expert_location.py``),
    built in ``ModelRunner.initialize`` before ``load_model``: the int64 maps
    ``logical_to_all_physical_map`` padded to ``[layers, experts, experts]``,
    ``physical_to_logical_map`` and ``…_num_valid`` (``[layers, experts]`` each), on the GPU."""
    experts = int(text.get("num_experts") or text.get("n_routed_experts") or 0)
    if arch not in EXPERT_LOCATION_ARCHS or experts <= 0:
        return 0
    layers = int(text["num_hidden_layers"])
    return layers * experts * (experts + 2) * 8


def _vision_factor_input(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    vision = cfg.get("vision_config")
    if not isinstance(vision, Mapping):
        return None
    return int(vision.get("num_hidden_layers") or 24), int(vision.get("hidden_size") or 1024)


def shape_from_config(cfg: Mapping[str, Any], source: str, name: str = "",
                      index_total: int | None = None) -> ModelShape:
    """Derive a :class:`ModelShape` from a parsed config.json (``source`` names the file)."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelConfigError(f"{source}: key 'architectures' missing")
    arch = str(archs[0])
    text = text_config(cfg)
    # Nemotron-H's layer count is its layers_block_type's length (num_hidden_layers deprecated).
    layers_key = () if arch == "NemotronHForCausalLM" else ("num_hidden_layers",)
    for key in ("hidden_size", *layers_key, "vocab_size"):
        _need(text, key, source)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    elem = w.DTYPE_BYTES.get(dtype, 2)
    kinds = _layer_kinds(text, arch, source)
    linear = sum(1 for k in kinds if k in STATE_KINDS)
    swa = _swa_layers(text, arch)
    per_layer, kv_heads, head_dim = _kv_cell(text, arch, elem, source)
    full = sum(1 for k in kinds if k in KV_KINDS) - swa
    state = _mamba_state(text, arch, source) if linear else {}
    conv, ssm = state.get("conv", 0) * linear, state.get("ssm", 0) * linear
    ssm_dtype = state.get("ssm_dtype", "float32")
    mtp = int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)
    gdn = state.get("kind") == "gdn"
    mtp_kept, mtp_loaded = w.mtp_weight_bytes(text, head_dim) if mtp and gdn else (0, 0)
    if index_total is not None:
        # The checkpoint's tensors, less the MTP layer loaded as the draft, plus rope buffers.
        rope_dim = int(text.get("qk_rope_head_dim") or head_dim) if arch in MLA_ARCHS else head_dim
        if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
            mtp_kept = w.deepseek_mtp_checkpoint_bytes(text, cfg)
        tensors = weights = (index_total - mtp_kept + w.rope_buffer_bytes(text, rope_dim)
                             + w.runtime_extra_bytes(arch, text))
    else:
        try:
            trace = w.trace_model(cfg, text, kinds, head_dim, arch)
        except KeyError as exc:
            raise ModelConfigError(f"{source}: key {exc.args[0]!r} missing") from exc
        tensors, weights = trace.tensor_bytes, trace.reserved
    eos = text.get("eos_token_id", cfg.get("eos_token_id")) or 0
    return ModelShape(
        name=name or source,
        weights_gib=weights / GIB,
        draft_weights_gib=mtp_kept / GIB,
        kv_bytes_per_token=per_layer * full,
        mamba_bytes_per_slot=conv + ssm,
        hybrid=linear > 0,
        context_length=context_length(text),
        mamba_conv_bytes_per_slot=conv,
        mamba_ssm_dtype=ssm_dtype,
        vision=_vision_factor_input(cfg),
        draft_kv_bytes_per_token=per_layer if mtp else 0,
        model_type=str(cfg.get("model_type", text.get("model_type", "generic"))),
        architecture=arch,
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        multimodal=arch in MULTIMODAL_ARCHS,
        piecewise_cuda_graph_disabled=arch in PIECEWISE_DISABLED_ARCHS,
        dtype_bytes=elem,
        kv_heads=kv_heads,
        full_attention_layers=full,
        linear_attention_layers=linear,
        swa_layers=swa,
        swa_kv_bytes_per_token=per_layer * swa,
        mtp_layers=mtp,
        draft_load_gib=mtp_loaded / GIB,
        pre_load_gib=expert_location_bytes(text, arch) / GIB,
        experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
        vocab_size=int(text["vocab_size"]),
        tied_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))),
        source=source,
        weights_source="safetensors index" if index_total is not None else "config",
        tensor_gib=tensors / GIB,
        mamba_kind=state.get("kind", ""),
        mamba_intermediate=state.get("intermediate", 0),
        mamba_groups=state.get("groups", 0),
        mamba_state_size=state.get("state", 0),
        mamba_heads=state.get("heads", 0),
        attention_heads=int(text.get("num_attention_heads") or 0),
    )


@lru_cache(maxsize=64)
def _read(path: str, mtime: float, name: str) -> ModelShape:
    config = Path(path)
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{config}: cannot read ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{config}: not a JSON object")
    return shape_from_config(cfg, str(config), name, index_total(config.parent))


def model_shape(model_path: str, env: Mapping[str, str] | None = None) -> ModelShape:
    """The shape of the model ``model_path`` names, from its config.json (cached per file)."""
    config = find_config(model_path, env)
    return _read(str(config), config.stat().st_mtime, model_path)
