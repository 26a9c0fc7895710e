"""GPU memory SGLang's model classes take for their weights, counted from a config.json.

``--load-format dummy`` (``model_loader/loader.py::DummyModelLoader``) builds the model class
under ``torch.device("cuda")`` and fills its parameters at random; a real checkpoint fills the same
tensors. ``Load weight end … mem usage=`` (``model_runner.py::load_model``) is the free memory
that took: the tensors, in the caching allocator's segments (:mod:`workers.engine.allocator`).
The counts (this module, :mod:`workers.engine.weights_families`, both built of
:mod:`workers.engine.weights_trace`) follow SGLang 0.5.11's modules in construction order
(``srt/models/llama.py``, ``qwen3.py``, ``qwen3_moe.py``, ``qwen2_moe.py``, ``qwen3_next.py``,
``qwen3_5.py``, ``qwen3_vl.py``, ``qwen3_5_mtp.py``; the families of issue 28: ``falcon_h1.py``,
``nemotron_h.py``, ``granitemoehybrid.py`` with ``layers/attention/mamba/mamba.py::MambaMixer2``,
``deepseek_v2.py`` with ``deepseek_common/deepseek_weight_loader.py::post_load_weights``,
``gpt_oss.py``, ``gemma3_causal.py``); the one buffer is the rotary ``cos_sin_cache``
(``layers/rotary_embedding/base.py``: ``[max_position, rotary_dim]`` in float32 on CUDA, one per
distinct rope since ``get_rope`` caches them, built from GPU temporaries that are freed).

Checked on the H200 (SGLang 0.5.11, torch 2.11): the logged ``mem usage`` of the tiny Qwen3
(0.04 GB), the 27B-shaped Qwen3.5 (50.89), a Llama-3.1-8B shape (15.02), a Qwen3-32B shape (61.04)
and a 24-layer Qwen3-Next shape (74.85) within the log's two decimals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.engine.weights_families import FAMILY_TRACERS, deepseek_mtp_checkpoint_bytes, gemma3
from workers.engine.weights_trace import (
    COUNTED_QUANT_METHODS,
    DTYPE_BYTES,
    FP32,
    Trace,
    cfg_get,
    dtype_bytes,
    fp8_block,
    padded_vocab,
    quant_method,
    rope_buffer_bytes,
    rope_shape,
)

# What model_config reads through this module.
__all__ = ["COUNTED_QUANT_METHODS", "DTYPE_BYTES", "Trace", "deepseek_mtp_checkpoint_bytes",
           "mtp_weight_bytes", "quant_method", "rope_buffer_bytes", "runtime_extra_bytes",
           "trace_model"]

def _attention(t: Trace, text: Mapping[str, Any], head_dim: int, gated: bool) -> None:
    """``qkv_proj`` (+bias for Qwen2), ``o_proj``, the rope, Qwen3's ``q_norm``/``k_norm``."""
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(cfg_get(text, "num_key_value_heads", heads))
    q_out = heads * head_dim * (2 if gated else 1)  # Qwen3.5/Next: query and output gate
    qkv = q_out + 2 * kv_heads * head_dim
    if str(text.get("model_type", "")).startswith("qwen3"):
        t.tensor(head_dim, head_dim)
    t.tensor(hidden * qkv)
    if cfg_get(text, "attention_bias", False) or text.get("model_type") == "qwen2":
        t.tensor(qkv)
    t.tensor(heads * head_dim * hidden)
    t.rope(*rope_shape(text, head_dim))


def _gated_delta_net(t: Trace, text: Mapping[str, Any]) -> None:
    """One linear-attention layer: conv1d, in_proj_qkvz, in_proj_ba, dt_bias, A_log (fp32),
    the gated norm, out_proj (``Qwen3GatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``)."""
    hidden = int(text["hidden_size"])
    key_dim = int(text["linear_key_head_dim"]) * int(text["linear_num_key_heads"])
    v_heads = int(text["linear_num_value_heads"])
    value_dim = int(text["linear_value_head_dim"]) * v_heads
    t.tensor((2 * key_dim + value_dim) * int(text["linear_conv_kernel_dim"]))
    t.tensor(hidden * (2 * key_dim + 2 * value_dim), hidden * 2 * v_heads, v_heads)
    t.tensor(v_heads, elem=FP32)
    t.tensor(int(text["linear_value_head_dim"]), value_dim * hidden)


def _mlp(t: Trace, text: Mapping[str, Any], layer: int) -> None:
    """Decoder layer ``layer``'s MLP: dense, or fused experts + router (+ shared expert)."""
    hidden = int(text["hidden_size"])
    experts = int(cfg_get(text, "num_experts", cfg_get(text, "num_local_experts", 0)))
    sparse_step = int(cfg_get(text, "decoder_sparse_step", 1))
    moe = (experts > 0 and layer not in set(cfg_get(text, "mlp_only_layers", []))
           and (layer + 1) % sparse_step == 0)
    if not moe:
        inter = int(text["intermediate_size"])
        t.tensor(hidden * 2 * inter, inter * hidden)
        return
    # Mixtral and OLMoE-style configs: the expert width is intermediate_size.
    inter = int(cfg_get(text, "moe_intermediate_size", text["intermediate_size"]))
    t.tensor(experts * 2 * inter * hidden, experts * hidden * inter, hidden * experts)
    shared = int(cfg_get(text, "shared_expert_intermediate_size", 0))
    if shared:
        t.tensor(hidden * 2 * shared, shared * hidden, hidden)  # shared_expert and its gate


def _vision(t: Trace, vision: Mapping[str, Any]) -> None:
    """``Qwen3VLMoeVisionModel``: patch and position embeddings, its rope, ``depth`` blocks
    (LayerNorms, qkv/proj and the MLP with biases) and the patch merger(s)."""
    hidden = int(vision["hidden_size"])
    inter = int(vision["intermediate_size"])
    patch = int(vision.get("patch_size", 16))
    merged = int(vision.get("spatial_merge_size", 2)) ** 2 * hidden
    out = int(vision["out_hidden_size"])
    channels = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2))
    t.tensor(channels * patch * patch * hidden, hidden)
    t.tensor(int(vision.get("num_position_embeddings", 0)) * hidden)
    head_dim = hidden // int(vision["num_heads"])
    t.rope(8192, head_dim // 2)
    for _ in range(int(vision["depth"])):
        t.tensor(hidden, hidden, hidden, hidden)
        t.tensor(3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden)
        t.tensor(inter * hidden, inter, hidden * inter, hidden)
    for _ in range(1 + len(vision.get("deepstack_visual_indexes") or [])):
        t.tensor(hidden, hidden, merged * merged, merged, out * merged, out)


def trace_model(
    top: Mapping[str, Any], text: Mapping[str, Any], layer_kinds: list[str], head_dim: int,
    arch: str = "",
) -> Trace:
    """The target model's allocations (``layer_kinds``: per decoder layer ``"attention"``,
    ``"linear"`` (Gated DeltaNet), ``"mamba"``, ``"parallel"`` (Falcon-H1's attention and Mamba-2
    side by side), ``"mlp"`` or ``"moe"``, as :mod:`workers.engine.model_config` reads them).
    MTP / NextN layers are not the target's: SGLang loads them as the draft
    (``qwen3_5.py::load_weights`` skips ``mtp`` names)."""
    family = FAMILY_TRACERS.get(arch)
    if family is not None:
        t = Trace(dtype_bytes(text), fp8_block=fp8_block(text, top),
                  mxfp4=quant_method(text, top) == "mxfp4")
        vision = top.get("vision_config")
        if arch == "Gemma3ForConditionalGeneration" and isinstance(vision, Mapping):
            gemma3(t, text, layer_kinds, head_dim, vision)
        else:
            family(t, text, layer_kinds, head_dim)
        return t
    t = Trace(dtype_bytes(text))
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    gated = bool(cfg_get(text, "attn_output_gate", "linear_num_value_heads" in text))
    vision = top.get("vision_config")
    if isinstance(vision, Mapping) and "depth" in vision and "out_hidden_size" in vision:
        _vision(t, vision)
    t.tensor(vocab * hidden)
    for layer, kind in enumerate(layer_kinds):
        if kind == "linear":
            _gated_delta_net(t, text)
        else:
            _attention(t, text, head_dim, gated)
        _mlp(t, text, layer)
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    if not bool(cfg_get(text, "tie_word_embeddings", cfg_get(top, "tie_word_embeddings", False))):
        t.tensor(vocab * hidden)
    return t


def runtime_extra_bytes(arch: str, text: Mapping[str, Any]) -> int:
    """What SGLang allocates beyond the checkpoint's tensors and one rope cache (added to an
    index's ``total_size``): MLA's ``w_kc``/``w_vc`` copies and the DeepSeek-YaRN rope's two
    extra tables (``_deepseek``), Gemma-3's second rope base, Falcon-H1's float32 head (the
    checkpoint's is bf16)."""
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        heads, kv_lora = int(text["num_attention_heads"]), int(text["kv_lora_rank"])
        # DeepseekV2Config's defaults where a key is absent (128 each).
        nope = int(cfg_get(text, "qk_nope_head_dim", 128))
        v_dim = int(cfg_get(text, "v_head_dim", 128))
        copies = heads * (nope + v_dim) * kv_lora * 2
        positions, rotary = rope_shape(text, int(text["qk_rope_head_dim"]))
        return int(text["num_hidden_layers"]) * copies + 2 * positions * rotary * FP32
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        head_dim = int(cfg_get(text, "head_dim", 256))
        return int(cfg_get(text, "max_position_embeddings", 8192)) * head_dim * FP32
    if arch == "FalconH1ForCausalLM":
        return padded_vocab(int(text["vocab_size"])) * int(text["hidden_size"]) * (
            FP32 - dtype_bytes(text))
    return 0


def mtp_weight_bytes(text: Mapping[str, Any], head_dim: int) -> tuple[int, int]:
    """(kept, loaded) bytes of a Qwen3.5/Next MTP draft (``qwen3_5_mtp.py``): ``fc`` (2H -> H),
    two norms, one full-attention decoder layer and the final norm are kept; its own
    ``embed_tokens`` and ``lm_head`` are allocated too, then swapped for the target's
    (``set_embed_and_head``), so they count only while the draft loads."""
    t = Trace(dtype_bytes(text))
    hidden = int(text["hidden_size"])
    t.tensor(2 * hidden * hidden, hidden, hidden)
    _attention(t, text, head_dim, bool(cfg_get(text, "attn_output_gate", True)))
    _mlp(t, text, 0)
    t.tensor(hidden, hidden, hidden)
    heads = int(text["vocab_size"]) * hidden * (1 if cfg_get(text, "tie_word_embeddings") else 2)
    kept = t.tensor_bytes - rope_buffer_bytes(text, head_dim)  # the target's rope is reused
    return kept, kept + heads * t.elem
