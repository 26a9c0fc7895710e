"""Weights counts of the families whose model classes are not Llama-shaped: SGLang 0.5.11's
``models/falcon_h1.py``, ``nemotron_h.py``, ``granitemoehybrid.py`` (with
``layers/attention/mamba/mamba.py::MambaMixer2``), ``deepseek_v2.py`` (with
``deepseek_common/deepseek_weight_loader.py::post_load_weights``), ``gpt_oss.py``,
``gemma3_causal.py`` (and ``siglip.py``) and ``olmoe.py``, in construction order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.engine.mamba2 import mamba2_params
from workers.engine.weights_trace import (
    FP32,
    Trace,
    cfg_get,
    dtype_bytes,
    embed,
    fp8_block,
    lm_head,
    mamba2_mixer,
    padded_vocab,
    qkv_o,
    rope_shape,
)


def _falcon_h1(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/falcon_h1.py``: every layer holds the rope, ``qkv_proj``/``o_proj``, a
    ``MambaMixer2``, the gated MLP, two norms, ``q_norm``/``k_norm`` and the ``mup_vector``
    buffer; the LM head is then cast to float32 (``self.lm_head = self.lm_head.float()``)."""
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    m = mamba2_params(text, "FalconH1ForCausalLM", int(text["hidden_size"]))
    embedding = embed(t, text)
    for _ in kinds:
        t.rope(*rope_shape(text, head_dim))
        qkv_o(t, text, head_dim)
        mamba2_mixer(t, hidden, m)
        t.linear(hidden, 2 * inter)
        t.linear(inter, hidden)
        t.tensor(hidden, hidden, head_dim, head_dim)
        t.tensor(2 * m["intermediate"] + 2 * m["groups"] * m["state"] + m["heads"])
    t.tensor(hidden)
    vocab = padded_vocab(int(text["vocab_size"]))
    if bool(cfg_get(text, "tie_word_embeddings", False)):
        t.free(embedding, vocab * hidden * t.elem)  # Module.float() replaces the shared weight
    else:
        index = len(t.events)
        t.tensor(vocab * hidden)
        t.free(index, vocab * hidden * t.elem)
    t.tensor(vocab * hidden, elem=FP32)


def _nemotron_h(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/nemotron_h.py``: per ``layers_block_type`` entry a Mamba-2 mixer, an attention
    block (no rope), a non-gated MLP (``relu2``) or a MoE block (float32 router and correction
    bias, non-gated experts, shared experts), each with one norm; then ``norm_f`` and the head."""
    hidden = int(text["hidden_size"])
    m = mamba2_params(text, "NemotronHForCausalLM", int(text["hidden_size"]))
    bias = bool(cfg_get(text, "mlp_bias", False))
    embed(t, text)
    for kind in kinds:
        if kind == "mamba":
            mamba2_mixer(t, hidden, m)
        elif kind == "attention":
            qkv_o(t, text, head_dim, bool(cfg_get(text, "attention_bias", False)))
        elif kind == "mlp":
            inter = int(text["intermediate_size"])
            t.linear(hidden, inter, bias=bias)
            t.linear(inter, hidden, bias=bias)
        else:
            experts = int(text["n_routed_experts"])
            t.tensor(hidden * experts, experts, elem=FP32)
            t.experts(experts, hidden, int(text["moe_intermediate_size"]), gated=False)
            shared = int(cfg_get(text, "moe_shared_expert_intermediate_size", 0)) * int(
                cfg_get(text, "n_shared_experts", 0))
            if shared:
                t.linear(hidden, shared, bias=bias)
                t.linear(shared, hidden, bias=bias)
        t.tensor(hidden)
    t.tensor(hidden)
    lm_head(t, text)


def _granite_hybrid(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/granitemoehybrid.py``: a Mamba-2 mixer or an attention block (rope only when
    ``position_embedding_type`` is ``rope``; head dim hidden / heads), then the MoE (router,
    gated experts) and the shared MLP, two norms; a tied head is allocated, then replaced by the
    embedding. Absent keys take ``configs/granitemoehybrid.py``'s defaults (``nope``, tied,
    ``shared_intermediate_size`` 8192, no experts)."""
    hidden = int(text["hidden_size"])
    m = mamba2_params(text, "GraniteMoeHybridForCausalLM", int(text["hidden_size"]))
    experts = int(cfg_get(text, "num_local_experts", 0))
    shared = int(cfg_get(text, "shared_intermediate_size", 8192))  # the config class's defaults
    embed(t, text)
    for kind in kinds:
        if kind == "mamba":
            mamba2_mixer(t, hidden, m)
        else:
            qkv_o(t, text, head_dim, bool(cfg_get(text, "attention_bias", False)))
            if cfg_get(text, "position_embedding_type", "nope") == "rope":
                t.rope(*rope_shape(text, head_dim))
        if experts:
            t.tensor(hidden * experts)
            t.experts(experts, hidden, int(text["intermediate_size"]))
        if shared:
            t.linear(hidden, 2 * shared)
            t.linear(shared, hidden)
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    vocab = padded_vocab(int(text["vocab_size"]))
    index = len(t.events)
    t.tensor(vocab * hidden)
    if bool(cfg_get(text, "tie_word_embeddings", True)):
        t.free(index, vocab * hidden * t.elem)


def _deepseek(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/deepseek_v2.py`` (V2, V3): MLA (``q_proj`` or the fused ``q_a`` path with
    ``q_lora_rank``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, ``kv_a_layernorm``, the
    DeepSeek-YaRN rope with its ``cos_cached_total``/``sin_cached_total``), a dense MLP for the
    first ``first_k_dense_replace`` layers (and off ``moe_layer_freq``), else the MoE gate
    (plus a float32 ``e_score_correction_bias`` under ``noaux_tc``), the routed experts and the
    shared experts' MLP; after loading, ``post_load_weights`` keeps ``w_kc``/``w_vc`` copies of
    each ``kv_b_proj`` (``deepseek_common/deepseek_weight_loader.py``)."""
    kv_lora = int(text["kv_lora_rank"])
    heads = int(text["num_attention_heads"])
    nope, v_dim = int(text["qk_nope_head_dim"]), int(text["v_head_dim"])
    experts = int(cfg_get(text, "n_routed_experts", 0))
    dense_k = int(cfg_get(text, "first_k_dense_replace", 0))
    freq = int(cfg_get(text, "moe_layer_freq", 1))
    embed(t, text)
    for layer in range(len(kinds)):
        _deepseek_layer(t, text, bool(experts and layer >= dense_k and layer % freq == 0))
    t.tensor(int(text["hidden_size"]))
    lm_head(t, text)
    for _ in kinds:
        t.tensor(heads * nope * kv_lora, heads * v_dim * kv_lora, elem=2)


def _deepseek_layer(t: Trace, text: Mapping[str, Any], sparse: bool) -> None:
    """One ``DeepseekV2DecoderLayer``: MLA, then the MoE block or the dense MLP, two norms."""
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    nope, rope_dim = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"])
    v_dim, kv_lora = int(text["v_head_dim"]), int(text["kv_lora_rank"])
    q_lora = cfg_get(text, "q_lora_rank")
    if q_lora:
        t.linear(hidden, int(q_lora) + kv_lora + rope_dim)
        t.tensor(int(q_lora))
        t.linear(int(q_lora), heads * (nope + rope_dim))
    else:
        t.linear(hidden, heads * (nope + rope_dim))
        t.linear(hidden, kv_lora + rope_dim)
    t.linear(kv_lora, heads * (nope + v_dim))
    t.linear(heads * v_dim, hidden)
    t.tensor(kv_lora)
    positions, rotary = rope_shape(text, rope_dim)
    if (positions, rotary, "deepseek") not in t.ropes:
        t.rope(positions, rotary, "deepseek")
        t.tensor(positions * rotary, positions * rotary, elem=FP32)
    if sparse:
        experts = int(text["n_routed_experts"])
        t.tensor(experts * hidden)
        if cfg_get(text, "topk_method") == "noaux_tc":
            t.tensor(experts, elem=FP32)
        t.experts(experts, hidden, int(text["moe_intermediate_size"]))
        shared = int(cfg_get(text, "n_shared_experts", 0)) * int(text["moe_intermediate_size"])
        if shared:
            t.linear(hidden, 2 * shared)
            t.linear(shared, hidden)
    else:
        inter = int(text["intermediate_size"])
        t.linear(hidden, 2 * inter)
        t.linear(inter, hidden)
    t.tensor(hidden, hidden)


def deepseek_mtp_checkpoint_bytes(text: Mapping[str, Any], top: Mapping[str, Any]) -> int:
    """The checkpoint bytes of DeepSeek-V3's ``num_nextn_predict_layers`` MTP layers (stored as
    ``model.layers.<num_hidden_layers + i>``: a MoE decoder layer, ``enorm``, ``hnorm``,
    ``eh_proj`` and its own ``embed_tokens`` and ``shared_head``): in an index's total but not
    in the target model ``DeepseekV3ForCausalLM`` builds (the NextN draft loads them)."""
    layers = int(cfg_get(text, "num_nextn_predict_layers", 0))
    if not layers:
        return 0
    t = Trace(dtype_bytes(text), fp8_block=fp8_block(text, top))
    hidden, vocab = int(text["hidden_size"]), padded_vocab(int(text["vocab_size"]))
    for _ in range(layers):
        _deepseek_layer(t, text, bool(cfg_get(text, "n_routed_experts", 0)))
        t.tensor(hidden, hidden, hidden)
        t.linear(2 * hidden, hidden)
        t.tensor(vocab * hidden, vocab * hidden)
    positions, rotary = rope_shape(text, int(text["qk_rope_head_dim"]))
    return t.tensor_bytes - 3 * positions * rotary * FP32  # no rope tables in a checkpoint


def _gpt_oss(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/gpt_oss.py`` (bf16 experts): ``qkv_proj`` and ``o_proj`` with biases, the
    per-head ``sinks`` (bf16 but on ``trtllm_mha``), the YaRN rope, ``FusedMoE`` with float32
    biases (expert width ``intermediate_size``), the router with its bias, two norms."""
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    experts = int(cfg_get(text, "num_local_experts", 0))
    bias = bool(cfg_get(text, "attention_bias", True))
    embed(t, text)
    for _ in kinds:
        kv_heads = int(cfg_get(text, "num_key_value_heads", heads))
        t.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
        t.tensor(heads)
        t.linear(heads * head_dim, hidden, bias=bias)
        t.rope(*rope_shape(text, head_dim))
        t.experts(experts, hidden, int(text["intermediate_size"]), bias=True)
        t.tensor(hidden * experts, experts)
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    lm_head(t, text)


def _siglip(t: Trace, vision: Mapping[str, Any], text_hidden: int) -> None:
    """Gemma-3's SigLIP tower (``models/siglip.py``: patch and position embeddings, per layer two
    LayerNorms, q/k/v/out and fc1/fc2 with biases, the post LayerNorm) and the projector
    (``gemma3_mm.py``: ``mm_input_projection_weight`` and ``mm_soft_emb_norm``)."""
    hidden = int(vision.get("hidden_size", 1152))
    inter = int(vision.get("intermediate_size", 4304))
    patch = int(vision.get("patch_size", 14))
    positions = (int(vision.get("image_size", 896)) // patch) ** 2
    t.tensor(3 * patch * patch * hidden, hidden, positions * hidden)
    for _ in range(int(vision.get("num_hidden_layers", 27))):
        t.tensor(hidden, hidden)
        t.linear(hidden, 3 * hidden, bias=True, quant=False)
        t.linear(hidden, hidden, bias=True, quant=False)
        t.tensor(hidden, hidden)
        t.linear(hidden, inter, bias=True, quant=False)
        t.linear(inter, hidden, bias=True, quant=False)
    t.tensor(hidden, hidden, hidden * text_hidden, hidden)


def gemma3(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int,
            vision: Mapping[str, Any] | None = None) -> None:
    """``models/gemma3_causal.py``: an unpadded ``nn.Embedding``; per layer ``qkv_proj``,
    ``o_proj``, one rope per base (``rope_local_base_freq`` on sliding layers, ``rope_theta``
    on global ones, both with default scaling), ``q_norm``/``k_norm``, the gated MLP and four
    norms; the head is tied by default."""
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    # Gemma3TextConfig's defaults where the text config leaves them out.
    positions = int(cfg_get(text, "max_position_embeddings", 131072))
    if vision is not None:
        _siglip(t, vision, hidden)
    embed(t, text, pad=False)
    pattern = int(cfg_get(text, "sliding_window_pattern", 6))
    for layer in range(len(kinds)):
        qkv_o(t, text, head_dim, bool(cfg_get(text, "attention_bias", False)))
        sliding = (layer + 1) % pattern != 0
        base = cfg_get(text, "rope_local_base_freq", 10000.0) if sliding else cfg_get(
            text, "rope_theta", 1000000.0)
        t.rope(positions, head_dim, float(base))
        t.tensor(head_dim, head_dim)
        t.linear(hidden, 2 * inter)
        t.linear(inter, hidden)
        t.tensor(hidden, hidden, hidden, hidden)
    t.tensor(hidden)
    lm_head(t, text, tied_default=True)


def _olmoe(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/olmoe.py``: ``qkv_proj``, ``q_norm`` and ``k_norm`` over the whole hidden size,
    ``o_proj``, the rope; the router and the gated experts of width ``intermediate_size``; two
    norms."""
    hidden = int(text["hidden_size"])
    experts = int(cfg_get(text, "num_experts", 0))
    embed(t, text)
    for _ in kinds:
        heads = int(text["num_attention_heads"])
        kv_heads = int(cfg_get(text, "num_key_value_heads", heads))
        t.linear(hidden, (heads + 2 * kv_heads) * head_dim)
        t.tensor(hidden, hidden)
        t.linear(heads * head_dim, hidden)
        t.rope(*rope_shape(text, head_dim))
        t.tensor(hidden * experts)
        t.experts(experts, hidden, int(text["intermediate_size"]))
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    lm_head(t, text)


FAMILY_TRACERS = {
    "FalconH1ForCausalLM": _falcon_h1,
    "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_hybrid,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "GptOssForCausalLM": _gpt_oss,
    "Gemma3ForCausalLM": gemma3,
    "Gemma3ForConditionalGeneration": gemma3,
    "OlmoeForCausalLM": _olmoe,
}
