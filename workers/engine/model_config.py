"""The shape of a model, read from its own config.json: what SGLang's pool arithmetic needs.

A profile's ``model-path`` is a local folder (or its config.json), or a hub id. A hub id is
looked up in the local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
``~/.cache/huggingface/hub``: ``models--org--name/snapshots/<rev>/config.json``), then in the
fleet's own ``config/models/`` (``org--name/config.json`` for the models the shipped profiles
name; a path that is not on this machine, as in a snapshot from another node, by its folder
name). The network is never used. A config that cannot be found or read raises
:class:`ModelConfigError` with one line naming the file and the key.

What each layer holds, the Mamba state and the KV cell are read by
:mod:`workers.engine.model_layers`, the weights by :mod:`workers.engine.weights`; what is derived
follows SGLang 0.5.11's ``configs/model_config.py`` (``_derive_model_shapes``,
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
from workers.engine.model_layers import (
    EXPERT_LOCATION_ARCHS,
    KV_KINDS,
    MLA_ARCHS,
    MULTIMODAL_ARCHS,
    NEMOTRON_PATTERN,
    PIECEWISE_DISABLED_ARCHS,
    STATE_KINDS,
    ModelConfigError,
    context_length,
    expert_location_bytes,
    kv_cell,
    layer_kinds,
    mamba_state,
    need,
    swa_layers,
    text_config,
    vision_factor_input,
)

# Read here by callers and tests (re-exported from model_layers).
__all__ = ["CONFIG_DIRS", "EXPERT_LOCATION_ARCHS", "MULTIMODAL_ARCHS", "NEMOTRON_PATTERN",
           "REPO_CONFIGS", "ModelConfigError", "ModelShape", "context_length", "find_config",
           "index_total", "model_shape", "shape_from_config", "text_config"]

GIB = 1024**3
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "config" / "models"
# Where hub ids and foreign paths are looked up after the HF cache (tests add fixture folders).
CONFIG_DIRS: list[Path] = [REPO_CONFIGS]


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
    mamba_conv_kernel: int = 0  # conv kernel width K (the conv state keeps K - 1 columns)
    attention_heads: int = 0  # num_attention_heads (the TP divisibility rule)
    first_layer_kind: str = "attention"  # what decoder layer 0 holds (_layer_kinds)
    mla: bool = False  # ModelConfig.attention_arch is MLA (ServerArgs.use_mla_backend)
    dsa: bool = False  # sparse MLA with an indexer (0.5.17 model_config.py::is_deepseek_dsa)
    index_gib: float = 0.0  # model.safetensors.index.json's total_size (0 without one)


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
        need(text, key, source)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    elem = w.DTYPE_BYTES.get(dtype, 2)
    kinds = layer_kinds(text, arch, source)
    linear = sum(1 for k in kinds if k in STATE_KINDS)
    swa = swa_layers(text, arch)
    per_layer, kv_heads, head_dim = kv_cell(text, arch, elem, source)
    full = sum(1 for k in kinds if k in KV_KINDS) - swa
    state = mamba_state(text, arch, source) if linear else {}
    conv, ssm = state.get("conv", 0) * linear, state.get("ssm", 0) * linear
    ssm_dtype = state.get("ssm_dtype", "float32")
    mtp = int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)
    gdn = state.get("kind") == "gdn"
    mtp_kept, mtp_loaded = w.mtp_weight_bytes(text, head_dim) if mtp and gdn else (0, 0)
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        mtp_kept = w.deepseek_mtp_checkpoint_bytes(text, cfg)  # the NextN draft's layer
    tensors, weights, weights_source = _weight_bytes(cfg, text, kinds, head_dim, arch, source,
                                                     index_total, mtp_kept)
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
        vision=vision_factor_input(cfg),
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
        weights_source=weights_source,
        tensor_gib=tensors / GIB,
        mamba_kind=state.get("kind", ""),
        mamba_intermediate=state.get("intermediate", 0),
        mamba_groups=state.get("groups", 0),
        mamba_state_size=state.get("state", 0),
        mamba_heads=state.get("heads", 0),
        mamba_conv_kernel=state.get("kernel", 0),
        attention_heads=int(text.get("num_attention_heads") or 0),
        mla=arch in MLA_ARCHS,
        dsa=arch in MLA_ARCHS and text.get("index_topk") is not None,
        first_layer_kind=kinds[0] if kinds else "attention",
        index_gib=(index_total or 0) / GIB,
    )


def _weight_bytes(cfg: Mapping[str, Any], text: Mapping[str, Any], kinds: list[str],
                  head_dim: int, arch: str, source: str, index_total: int | None,
                  mtp_kept: int) -> tuple[int, int, str]:
    """(tensor bytes, what ``Load weight end … mem usage`` shows, where they came from).

    SGLang's model class allocates its parameters from config.json; the checkpoint only fills
    them (``DefaultModelLoader`` copies into them, ``DummyModelLoader`` fills them at random), so
    the GPU holds the same bytes with or without a ``model.safetensors.index.json``: the config's
    count wins whenever the config can be counted and its quantization is one the count models.
    The index's ``total_size`` is used only where it cannot (a key the count needs is missing,
    or a ``quantization_config`` it does not model, e.g. GPTQ/AWQ): the checkpoint's tensors,
    less the MTP layer the draft loads, plus the rope buffers and what the engine adds at load,
    in the caching allocator's segments as the config count would place them."""
    trace, missing = None, None
    try:
        trace = w.trace_model(cfg, text, kinds, head_dim, arch)
    except KeyError as exc:
        missing = exc.args[0]
    if trace is not None and (index_total is None
                              or w.quant_method(text, cfg) in w.COUNTED_QUANT_METHODS):
        return trace.tensor_bytes, trace.reserved, "config"
    if index_total is None:
        raise ModelConfigError(f"{source}: key {missing!r} missing")
    rope_dim = int(text.get("qk_rope_head_dim") or head_dim) if arch in MLA_ARCHS else head_dim
    tensors = (index_total - mtp_kept + w.rope_buffer_bytes(text, rope_dim)
               + w.runtime_extra_bytes(arch, text))
    overhead = trace.reserved - trace.tensor_bytes if trace is not None else 0
    return tensors, tensors + overhead, "safetensors index"


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
