"""GPU memory SGLang's model classes take for their weights, counted from a config.json.

``--load-format dummy`` (``model_loader/loader.py::DummyModelLoader``) builds the model class
under ``torch.device("cuda")`` and fills its parameters at random; a real checkpoint fills the same
tensors. ``Load weight end … mem usage=`` (``model_runner.py::load_model``) is the free memory
that took: the tensors, in the caching allocator's segments (:mod:`workers.engine.allocator`).
The tensors below follow SGLang 0.5.11's modules in construction order (``srt/models/llama.py``,
``qwen3.py``, ``qwen3_moe.py``, ``qwen2_moe.py``, ``qwen3_next.py``, ``qwen3_5.py``,
``qwen3_vl.py``, ``qwen3_5_mtp.py``); the one buffer is the rotary ``cos_sin_cache``
(``layers/rotary_embedding/base.py``: ``[max_position, rotary_dim]`` in float32 on CUDA, one per
distinct rope since ``get_rope`` caches them, built from GPU temporaries that are freed).

Checked on the H200 (SGLang 0.5.11, torch 2.11): the logged ``mem usage`` of the tiny Qwen3
(0.04 GB), the 27B-shaped Qwen3.5 (50.89), a Llama-3.1-8B shape (15.02), a Qwen3-32B shape (61.04)
and a 24-layer Qwen3-Next shape (74.85) within the log's two decimals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engine.allocator import reserved_bytes

# The KV pool and the weights count bytes per element of these dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP32 = 4


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    return default if value is None else value


@dataclass
class Trace:
    """The model's GPU allocations in construction order, and their exact sum."""

    elem: int  # bytes per element of the model's dtype
    events: list[tuple[str, int, int]] = field(default_factory=list)
    tensor_bytes: int = 0
    ropes: set[tuple[int, int]] = field(default_factory=set)

    def tensor(self, *numels: int, elem: int | None = None) -> None:
        """One live tensor per ``numel`` (a weight, a bias, a norm)."""
        for numel in numels:
            size = numel * (elem or self.elem)
            self.events.append(("a", len(self.events), size))
            self.tensor_bytes += size

    def rope(self, positions: int, rotary_dim: int) -> None:
        """``_compute_cos_sin_cache``: t, freqs, cos, sin, then the cache; the rest freed."""
        if (positions, rotary_dim) in self.ropes:
            return
        self.ropes.add((positions, rotary_dim))
        half = positions * rotary_dim // 2 * FP32
        temps = [rotary_dim // 2 * FP32, positions * FP32, half, half, half]
        first = len(self.events)
        for size in temps:
            self.events.append(("a", len(self.events), size))
        self.tensor(positions * rotary_dim, elem=FP32)
        self.events += [("f", first + i, 0) for i in range(len(temps))]

    @property
    def reserved(self) -> int:
        """What ``mem_get_info`` sees the tensors take (after ``empty_cache``)."""
        return reserved_bytes(self.events)


def rope_shape(text: Mapping[str, Any], head_dim: int) -> tuple[int, int]:
    """(positions, rotary_dim) of the text model's rope cache (YaRN: original x factor)."""
    rope = _get(text, "rope_scaling") or _get(text, "rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", _get(text, "partial_rotary_factor", 1.0)))
    positions = int(_get(text, "max_position_embeddings", 8192))
    if rope.get("rope_type", rope.get("type")) == "yarn":
        original = int(rope.get("original_max_position_embeddings", positions))
        positions = int(original * float(rope.get("factor", 1.0)))
    return positions, int(head_dim * factor)


def rope_buffer_bytes(text: Mapping[str, Any], head_dim: int) -> int:
    """Bytes of the text model's ``cos_sin_cache``."""
    positions, rotary_dim = rope_shape(text, head_dim)
    return positions * rotary_dim * FP32


def _attention(t: Trace, text: Mapping[str, Any], head_dim: int, gated: bool) -> None:
    """``qkv_proj`` (+bias for Qwen2), ``o_proj``, the rope, Qwen3's ``q_norm``/``k_norm``."""
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(_get(text, "num_key_value_heads", heads))
    q_out = heads * head_dim * (2 if gated else 1)  # Qwen3.5/Next: query and output gate
    qkv = q_out + 2 * kv_heads * head_dim
    if str(text.get("model_type", "")).startswith("qwen3"):
        t.tensor(head_dim, head_dim)
    t.tensor(hidden * qkv)
    if _get(text, "attention_bias", False) or text.get("model_type") == "qwen2":
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
    experts = int(_get(text, "num_experts", _get(text, "num_local_experts", 0)))
    sparse_step = int(_get(text, "decoder_sparse_step", 1))
    moe = (experts > 0 and layer not in set(_get(text, "mlp_only_layers", []))
           and (layer + 1) % sparse_step == 0)
    if not moe:
        inter = int(text["intermediate_size"])
        t.tensor(hidden * 2 * inter, inter * hidden)
        return
    inter = int(text["moe_intermediate_size"])
    t.tensor(experts * 2 * inter * hidden, experts * hidden * inter, hidden * experts)
    shared = int(_get(text, "shared_expert_intermediate_size", 0))
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


def _dtype_bytes(text: Mapping[str, Any]) -> int:
    return DTYPE_BYTES.get(str(_get(text, "torch_dtype", _get(text, "dtype", "bfloat16"))), 2)


def trace_model(
    top: Mapping[str, Any], text: Mapping[str, Any], layer_kinds: list[str], head_dim: int
) -> Trace:
    """The target model's allocations (``layer_kinds``: ``"attention"`` or ``"linear"`` per
    decoder layer). MTP / NextN layers are not the target's: SGLang loads them as the draft
    (``qwen3_5.py::load_weights`` skips ``mtp`` names)."""
    t = Trace(_dtype_bytes(text))
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    gated = bool(_get(text, "attn_output_gate", "linear_num_value_heads" in text))
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
    if not bool(_get(text, "tie_word_embeddings", _get(top, "tie_word_embeddings", False))):
        t.tensor(vocab * hidden)
    return t


def mtp_weight_bytes(text: Mapping[str, Any], head_dim: int) -> tuple[int, int]:
    """(kept, loaded) bytes of a Qwen3.5/Next MTP draft (``qwen3_5_mtp.py``): ``fc`` (2H -> H),
    two norms, one full-attention decoder layer and the final norm are kept; its own
    ``embed_tokens`` and ``lm_head`` are allocated too, then swapped for the target's
    (``set_embed_and_head``), so they count only while the draft loads."""
    t = Trace(_dtype_bytes(text))
    hidden = int(text["hidden_size"])
    t.tensor(2 * hidden * hidden, hidden, hidden)
    _attention(t, text, head_dim, bool(_get(text, "attn_output_gate", True)))
    _mlp(t, text, 0)
    t.tensor(hidden, hidden, hidden)
    heads = int(text["vocab_size"]) * hidden * (1 if _get(text, "tie_word_embeddings") else 2)
    kept = t.tensor_bytes - rope_buffer_bytes(text, head_dim)  # the target's rope is reused
    return kept, kept + heads * t.elem
