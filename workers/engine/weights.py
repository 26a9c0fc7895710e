"""Bytes of weights SGLang allocates for a model, counted from its config.json.

``--load-format dummy`` (``model_loader/loader.py::DummyModelLoader``) allocates exactly the
parameters of SGLang's model class and fills them at random, and a real checkpoint fills the
same tensors; the ``Load weight end … mem usage=`` line of ``model_runner.py::load_model`` is
that allocation plus the buffers the modules register. The counts below follow the modules of
SGLang 0.5.11 (``srt/models/llama.py``, ``qwen3.py``, ``qwen3_moe.py``, ``qwen3_next.py``,
``qwen3_5.py``, ``qwen3_vl.py``, ``qwen3_5_mtp.py``); the buffer is the rotary
``cos_sin_cache`` (``layers/rotary_embedding/base.py``: ``[max_position, rotary_dim]`` float32 on
CUDA, one per distinct rope because ``get_rope`` caches them).

Checked on the H200: the 27B-shaped Qwen3.5 folder counts 50.863 GiB of tensors (logged
``mem usage=50.89``, ``avail mem`` 139.13 -> 88.23), the tiny Qwen3 0.013 GiB (logged 0.04,
139.13 -> 139.08). Both runs took 28-38 MiB more than their tensors (the two readings of the
same two-decimal lines), the same for a 13 MiB and a 51 GiB model: the CUDA runtime's (kernel
modules loaded by the initialisation, allocator segments), not a tensor of SGLang's.
:data:`LOAD_RUNTIME_BYTES` books it, measured, so a prediction without a log is as close as
the log's rounding; a live engine's log replaces the whole figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The KV pool and the weights count bytes per element of these dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP32 = 4
# Measured on the H200 (torch 2.11+cu130), see the module docstring: 33 MiB, the middle of the
# 28-38 MiB that the logged lines allow, in both runs.
LOAD_RUNTIME_BYTES = 33 * 1024**2


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def rope_buffer_bytes(text: Mapping[str, Any], head_dim: int) -> int:
    """The ``cos_sin_cache`` of the text model's rope (float32 on CUDA, shared by all layers)."""
    rope = _get(text, "rope_scaling") or _get(text, "rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", _get(text, "partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor)
    positions = int(_get(text, "max_position_embeddings", 8192))
    if rope.get("rope_type", rope.get("type")) == "yarn":
        original = int(rope.get("original_max_position_embeddings", positions))
        positions = int(original * float(rope.get("factor", 1.0)))
    return positions * rotary_dim * FP32


def _attention(text: Mapping[str, Any], hidden: int, head_dim: int, gated: bool) -> int:
    """``qkv_proj`` + ``o_proj`` (+ Qwen3's ``q_norm``/``k_norm``) of one full-attention layer."""
    heads = int(text["num_attention_heads"])
    kv_heads = int(_get(text, "num_key_value_heads", heads))
    q_out = heads * head_dim * (2 if gated else 1)  # Qwen3.5/Next: query and output gate
    params = hidden * (q_out + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    if _get(text, "attention_bias", False) or text.get("model_type") == "qwen2":
        params += q_out + 2 * kv_heads * head_dim
    if str(text.get("model_type", "")).startswith("qwen3"):
        params += 2 * head_dim
    return params


def _gated_delta_net(text: Mapping[str, Any], hidden: int) -> tuple[int, int]:
    """(bf16 params, fp32 params) of one linear-attention (GatedDeltaNet) layer."""
    key_dim = int(text["linear_key_head_dim"]) * int(text["linear_num_key_heads"])
    v_heads = int(text["linear_num_value_heads"])
    value_dim = int(text["linear_value_head_dim"]) * v_heads
    conv = (2 * key_dim + value_dim) * int(text["linear_conv_kernel_dim"])
    qkvz = hidden * (2 * key_dim + 2 * value_dim)
    params = conv + qkvz + hidden * 2 * v_heads + v_heads + int(text["linear_value_head_dim"])
    return params + value_dim * hidden, v_heads  # A_log is float32


def _mlp(text: Mapping[str, Any], hidden: int, layer: int) -> int:
    """The MLP of decoder layer ``layer``: dense, or experts + router (+ shared expert)."""
    experts = int(_get(text, "num_experts", _get(text, "num_local_experts", 0)))
    sparse_step = int(_get(text, "decoder_sparse_step", 1))
    dense_layers = set(_get(text, "mlp_only_layers", []))
    moe = experts > 0 and layer not in dense_layers and (layer + 1) % sparse_step == 0
    if not moe:
        return 3 * hidden * int(text["intermediate_size"])
    params = experts * 3 * hidden * int(text["moe_intermediate_size"]) + hidden * experts
    shared = int(_get(text, "shared_expert_intermediate_size", 0))
    if shared:
        params += 3 * hidden * shared + hidden  # shared_expert + shared_expert_gate
    return params


def _vision(vision: Mapping[str, Any]) -> int:
    """``Qwen3VLMoeVisionModel`` (Qwen3-VL / Qwen3.5 tower): patch and position embeddings,
    ``depth`` blocks (LayerNorms, qkv/proj with bias, MLP with bias) and the patch merger."""
    hidden = int(vision["hidden_size"])
    inter = int(vision["intermediate_size"])
    patch = int(vision.get("patch_size", 16))
    merge = int(vision.get("spatial_merge_size", 2)) ** 2
    out = int(vision["out_hidden_size"])
    block = 4 * hidden + (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden)
    block += 2 * hidden * inter + inter + hidden
    embed = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2))
    embed = embed * patch * patch * hidden + hidden
    embed += int(vision.get("num_position_embeddings", 0)) * hidden
    merger = 2 * hidden + (merge * hidden) ** 2 + merge * hidden + merge * hidden * out + out
    mergers = 1 + len(vision.get("deepstack_visual_indexes") or [])
    return int(vision["depth"]) * block + embed + mergers * merger


def _vision_rope_bytes(vision: Mapping[str, Any]) -> int:
    """The vision tower's own rope cache (``max_position=8192``, rotary_dim = head_dim / 2)."""
    head_dim = int(vision["hidden_size"]) // int(vision["num_heads"])
    return 8192 * (head_dim // 2) * FP32


def count_weight_bytes(
    top: Mapping[str, Any], text: Mapping[str, Any], layer_kinds: list[str], head_dim: int
) -> int:
    """Bytes of the target model's parameters and buffers, in the config's dtype.

    ``layer_kinds`` holds ``"attention"`` or ``"linear"`` per decoder layer. MTP / NextN layers
    are not counted: SGLang loads them as a separate draft model (``qwen3_5.py::load_weights``
    skips ``mtp`` names).
    """
    elem = DTYPE_BYTES.get(str(_get(text, "torch_dtype", _get(text, "dtype", "bfloat16"))), 2)
    hidden = int(text["hidden_size"])
    vocab = int(text["vocab_size"])
    gated = bool(_get(text, "attn_output_gate", "linear_num_value_heads" in text))
    params, fp32 = 0, 0
    for layer, kind in enumerate(layer_kinds):
        if kind == "linear":
            bf16, a_log = _gated_delta_net(text, hidden)
            params, fp32 = params + bf16, fp32 + a_log
        else:
            params += _attention(text, hidden, head_dim, gated)
        params += _mlp(text, hidden, layer) + 2 * hidden
    tied = bool(_get(text, "tie_word_embeddings", _get(top, "tie_word_embeddings", False)))
    params += vocab * hidden * (1 if tied else 2) + hidden
    buffers = rope_buffer_bytes(text, head_dim)
    vision = top.get("vision_config")
    if isinstance(vision, Mapping) and "depth" in vision and "out_hidden_size" in vision:
        params += _vision(vision)
        buffers += _vision_rope_bytes(vision)
    return params * elem + fp32 * FP32 + buffers


def mtp_weight_bytes(text: Mapping[str, Any], head_dim: int) -> tuple[int, int]:
    """(kept, loaded) bytes of a Qwen3.5/Next MTP draft (``qwen3_5_mtp.py``): ``fc`` (2H -> H),
    two norms, one full-attention decoder layer and the final norm are kept; its own
    ``embed_tokens`` and ``lm_head`` are allocated too, then swapped for the target's
    (``set_embed_and_head``), so they count only while the draft loads."""
    elem = DTYPE_BYTES.get(str(_get(text, "torch_dtype", _get(text, "dtype", "bfloat16"))), 2)
    hidden = int(text["hidden_size"])
    gated = bool(_get(text, "attn_output_gate", True))
    layer = _attention(text, hidden, head_dim, gated) + _mlp(text, hidden, 0) + 2 * hidden
    kept = (2 * hidden * hidden + 3 * hidden + layer) * elem
    tied = bool(_get(text, "tie_word_embeddings", False))
    heads = int(text["vocab_size"]) * hidden * (1 if tied else 2) * elem
    return kept, kept + heads
