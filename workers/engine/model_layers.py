"""What a config.json says about a model's layers, as SGLang 0.5.11 reads it: the architecture
lists of ``configs/model_config.py``, which decoder layer holds a KV cache or a Mamba state
(``configs/qwen3_next.py``, ``falcon_h1.py``, ``nemotron_h.py``, ``granitemoehybrid.py``), one
layer's Mamba state (``configs/mamba_utils.py::Mamba2StateShape.create``), the KV cell
(``model_executor/pool_configurator.py``; MLA's latent), the sliding-window layers, the context
length and the expert-location tables built before the weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.engine.mamba2 import mamba2_params
from workers.engine.weights_trace import DTYPE_BYTES

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


def need(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    """``cfg[key]``; ModelConfigError naming ``source`` and the key where it is absent."""
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


def layer_kinds(text: Mapping[str, Any], arch: str, source: str) -> list[str]:
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
            pattern = str(need(text, "hybrid_override_pattern", source))
            kinds = [NEMOTRON_PATTERN[c] for c in pattern if c in NEMOTRON_PATTERN]
        return [str(k) for k in kinds]
    layers = int(need(text, "num_hidden_layers", source))
    if arch == "FalconH1ForCausalLM":
        return ["parallel"] * layers
    if arch == "GraniteMoeHybridForCausalLM":
        kinds = text.get("layer_types") or [
            "attention" if (i + 1) % 6 == 0 else "mamba" for i in range(layers)]
        return [str(k) for k in kinds]
    if text.get("model_type") not in HYBRID_LINEAR_TYPES:
        return ["attention"] * layers
    interval = int(need(text, "full_attention_interval", source))
    return ["attention" if (i + 1) % interval == 0 else "linear" for i in range(layers)]


def mamba_state(text: Mapping[str, Any], arch: str, source: str) -> dict:
    """The Mamba state of one layer at tp=1 (``Mamba2StateShape.create``): conv
    ``(intermediate + 2 x groups x state) x (kernel - 1)`` in bf16 (``SGLANG_MAMBA_CONV_DTYPE``),
    SSM ``heads x head_dim x state`` in the SSM dtype. Gated DeltaNet passes value heads x value
    dim as the intermediate size, key heads as groups and the key dim as the state
    (``configs/qwen3_next.py::mamba2_cache_params``)."""
    if arch in MAMBA2_ARCHS:
        m = mamba2_params(text, arch, int(need(text, "hidden_size", source)))
        m["kind"] = "mamba2"
    else:
        k_heads = int(need(text, "linear_num_key_heads", source))
        v_heads = int(need(text, "linear_num_value_heads", source))
        v_dim = int(need(text, "linear_value_head_dim", source))
        m = {"kind": "gdn", "intermediate": v_heads * v_dim, "groups": k_heads,
             "heads": v_heads, "head_dim": v_dim,
             "state": int(need(text, "linear_key_head_dim", source)),
             "kernel": int(need(text, "linear_conv_kernel_dim", source)),
             "ssm_dtype": str(text.get("mamba_ssm_dtype") or "float32")}
    m["conv"] = (m["intermediate"] + 2 * m["groups"] * m["state"]) * (m["kernel"] - 1) * 2
    m["ssm"] = m["heads"] * m["head_dim"] * m["state"] * DTYPE_BYTES.get(m["ssm_dtype"], 4)
    return m


def kv_cell(text: Mapping[str, Any], arch: str, elem: int, source: str) -> tuple[int, int, int]:
    """(bytes per token per layer, total KV heads, head_dim) of the full-attention KV cache."""
    if arch in MLA_ARCHS:
        latent = int(need(text, "kv_lora_rank", source)) + int(
            need(text, "qk_rope_head_dim", source))
        return latent * elem, 0, 256
    heads = int(need(text, "num_attention_heads", source))
    hidden = int(need(text, "hidden_size", source))
    # NemotronHConfig takes head_dim (default 128), never attention_head_dim.
    fallback = 128 if arch == "NemotronHForCausalLM" else hidden // heads
    head_dim = int(text.get("head_dim") or fallback)
    v_head_dim = int(text.get("v_head_dim") or head_dim)
    kv_heads = 1 if text.get("multi_query") else int(text.get("num_key_value_heads") or heads)
    return kv_heads * (head_dim + v_head_dim) * elem, kv_heads, head_dim


def swa_layers(text: Mapping[str, Any], arch: str) -> int:
    """Sliding-window layers SGLang gives their own pool (``get_hybrid_layer_ids``)."""
    if arch not in HYBRID_SWA_ARCHS:
        return 0
    if arch == "Llama4ForConditionalGeneration":
        return sum(1 for i in range(int(text["num_hidden_layers"])) if (i + 1) % 4 != 0)
    return sum(1 for t in text.get("layer_types") or [] if t == "sliding_attention")


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


def vision_factor_input(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    """The vision tower as ``adjust_mem_fraction_for_vlm`` reads it (None without one)."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, Mapping):
        return None
    return int(vision.get("num_hidden_layers") or 24), int(vision.get("hidden_size") or 1024)
