"""GPU memory SGLang's model classes take for their weights, counted from a config.json.

``--load-format dummy`` (``model_loader/loader.py::DummyModelLoader``) builds the model class
under ``torch.device("cuda")`` and fills its parameters at random; a real checkpoint fills the same
tensors. ``Load weight end … mem usage=`` (``model_runner.py::load_model``) is the free memory
that took: the tensors, in the caching allocator's segments (:mod:`workers.engine.allocator`).
The tensors below follow SGLang 0.5.11's modules in construction order (``srt/models/llama.py``,
``qwen3.py``, ``qwen3_moe.py``, ``qwen2_moe.py``, ``qwen3_next.py``, ``qwen3_5.py``,
``qwen3_vl.py``, ``qwen3_5_mtp.py``; the families of issue 28: ``falcon_h1.py``,
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
from dataclasses import dataclass, field
from typing import Any

from workers.engine.allocator import reserved_bytes
from workers.engine.mamba2 import mamba2_params

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
    ropes: set[tuple[int, int, object]] = field(default_factory=set)
    fp8_block: int = 0  # an fp8 checkpoint's weight_block_size (0: weights in the model dtype)
    mxfp4: bool = False  # an mxfp4 checkpoint (gpt-oss as published): its experts in 4 bits

    def tensor(self, *numels: int, elem: int | None = None) -> None:
        """One live tensor per ``numel`` (a weight, a bias, a norm)."""
        for numel in numels:
            size = numel * (elem or self.elem)
            self.events.append(("a", len(self.events), size))
            self.tensor_bytes += size

    def linear(self, n_in: int, n_out: int, bias: bool = False, quant: bool = True) -> None:
        """A ``*ParallelLinear`` of ``n_in -> n_out``: its weight (fp8 plus the float32
        ``weight_scale_inv`` of each 128 x 128 block under an ``fp8`` block quantization,
        ``layers/quantization/fp8.py``), then its bias."""
        if quant and self.fp8_block:
            block = self.fp8_block
            self.tensor(n_in * n_out, elem=1)
            self.tensor(-(-n_out // block) * -(-n_in // block), elem=FP32)
        else:
            self.tensor(n_in * n_out)
        if bias:
            self.tensor(n_out)

    def experts(self, experts: int, hidden: int, inter: int, gated: bool = True,
                bias: bool = False) -> None:
        """``FusedMoE``'s ``w13_weight`` ``[E, 2I (I ungated), H]`` and ``w2_weight`` ``[E, H,
        I]`` (``layers/quantization/unquant.py::UnquantizedFusedMoEMethod.create_weights``; with
        ``with_bias`` float32 biases after each), fp8 with block scales when quantized."""
        up = (2 if gated else 1) * inter
        if self.mxfp4:
            # layers/quantization/mxfp4.py::Mxfp4MoEMethod.create_weights (no padding on Hopper
            # without triton_kernels): uint8 pairs of e2m1, a uint8 scale per 32, bf16 biases.
            for rows, cols in ((up, hidden), (hidden, inter)):
                self.tensor(experts * rows * cols // 2, experts * rows * cols // 32, elem=1)
                self.tensor(experts * rows, elem=2)
            return
        for rows, cols, width in ((up, hidden, up), (hidden, inter, hidden)):
            if self.fp8_block:
                block = self.fp8_block
                self.tensor(experts * rows * cols, elem=1)
                self.tensor(experts * -(-rows // block) * -(-cols // block), elem=FP32)
            else:
                self.tensor(experts * rows * cols)
            if bias:
                self.tensor(experts * width, elem=FP32)

    def rope(self, positions: int, rotary_dim: int, base: object = None) -> None:
        """``_compute_cos_sin_cache``: t, freqs, cos, sin, then the cache; the rest freed."""
        if (positions, rotary_dim, base) in self.ropes:  # get_rope caches by its arguments
            return
        self.ropes.add((positions, rotary_dim, base))
        half = positions * rotary_dim // 2 * FP32
        temps = [rotary_dim // 2 * FP32, positions * FP32, half, half, half]
        first = len(self.events)
        for size in temps:
            self.events.append(("a", len(self.events), size))
        self.tensor(positions * rotary_dim, elem=FP32)
        self.events += [("f", first + i, 0) for i in range(len(temps))]

    def free(self, index: int, size: int) -> None:
        """The tensor allocated as event ``index`` (of ``size`` bytes) is released."""
        self.events.append(("f", index, 0))
        self.tensor_bytes -= size

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
    # Mixtral and OLMoE-style configs: the expert width is intermediate_size.
    inter = int(_get(text, "moe_intermediate_size", text["intermediate_size"]))
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


VOCAB_PADDING = 64  # layers/vocab_parallel_embedding.py::DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab: int) -> int:
    """``pad_vocab_size``: ``VocabParallelEmbedding`` and ``ParallelLMHead`` round the vocabulary
    up to a multiple of 64."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


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
        t = Trace(_dtype_bytes(text), fp8_block=_fp8_block(text, top),
                  mxfp4=_quant_method(text, top) == "mxfp4")
        vision = top.get("vision_config")
        if arch == "Gemma3ForConditionalGeneration" and isinstance(vision, Mapping):
            _gemma3(t, text, layer_kinds, head_dim, vision)
        else:
            family(t, text, layer_kinds, head_dim)
        return t
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


def _quant_method(text: Mapping[str, Any], top: Mapping[str, Any]) -> str:
    quant = _get(text, "quantization_config", _get(top, "quantization_config"))
    return str(quant.get("quant_method", "")) if isinstance(quant, Mapping) else ""


def _fp8_block(text: Mapping[str, Any], top: Mapping[str, Any]) -> int:
    """The block of an ``fp8`` checkpoint's ``quantization_config`` (DeepSeek-V3: 128), else 0."""
    quant = _get(text, "quantization_config", _get(top, "quantization_config"))
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return 0
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0])


def _embed(t: Trace, text: Mapping[str, Any], pad: bool = True) -> int:
    """``embed_tokens``: [padded vocab, hidden]; returns its event index."""
    vocab = int(text["vocab_size"])
    index = len(t.events)
    t.tensor((padded_vocab(vocab) if pad else vocab) * int(text["hidden_size"]))
    return index


def _lm_head(t: Trace, text: Mapping[str, Any], tied_default: bool = False) -> None:
    """``ParallelLMHead`` unless ``tie_word_embeddings`` (then the embedding is reused)."""
    if not bool(_get(text, "tie_word_embeddings", tied_default)):
        t.tensor(padded_vocab(int(text["vocab_size"])) * int(text["hidden_size"]))


def mamba2_mixer(t: Trace, hidden: int, m: Mapping[str, Any]) -> None:
    """``layers/attention/mamba/mamba.py::MambaMixer2`` at tp=1: ``conv1d`` ([conv_dim, kernel]
    and its bias; never quantized), ``in_proj`` (hidden -> intermediate + conv_dim + heads),
    ``A`` (float32), ``D``, ``dt_bias``, ``out_proj`` and, with ``use_rms_norm``, the gated norm's
    weight; conv_dim = intermediate + 2 x groups x state."""
    inter, heads = m["intermediate"], m["heads"]
    conv_dim = inter + 2 * m["weight_groups"] * m["state"]
    t.linear(m["kernel"], conv_dim, bias=m["conv_bias"], quant=False)
    t.linear(hidden, inter + conv_dim + heads, bias=m["proj_bias"])
    t.tensor(heads, elem=FP32)
    t.tensor(heads, heads)
    t.linear(inter, hidden, bias=m["proj_bias"])
    if m["rms_norm"]:
        t.tensor(inter)


def _qkv_o(t: Trace, text: Mapping[str, Any], head_dim: int, bias: bool = False) -> None:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(_get(text, "num_key_value_heads", heads))
    t.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
    t.linear(heads * head_dim, hidden, bias=bias)


def _falcon_h1(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/falcon_h1.py``: every layer holds the rope, ``qkv_proj``/``o_proj``, a
    ``MambaMixer2``, the gated MLP, two norms, ``q_norm``/``k_norm`` and the ``mup_vector``
    buffer; the LM head is then cast to float32 (``self.lm_head = self.lm_head.float()``)."""
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    m = mamba2_params(text, "FalconH1ForCausalLM", int(text["hidden_size"]))
    embed = _embed(t, text)
    for _ in kinds:
        t.rope(*rope_shape(text, head_dim))
        _qkv_o(t, text, head_dim)
        mamba2_mixer(t, hidden, m)
        t.linear(hidden, 2 * inter)
        t.linear(inter, hidden)
        t.tensor(hidden, hidden, head_dim, head_dim)
        t.tensor(2 * m["intermediate"] + 2 * m["groups"] * m["state"] + m["heads"])
    t.tensor(hidden)
    vocab = padded_vocab(int(text["vocab_size"]))
    if bool(_get(text, "tie_word_embeddings", False)):
        t.free(embed, vocab * hidden * t.elem)  # Module.float() replaces the shared weight
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
    bias = bool(_get(text, "mlp_bias", False))
    _embed(t, text)
    for kind in kinds:
        if kind == "mamba":
            mamba2_mixer(t, hidden, m)
        elif kind == "attention":
            _qkv_o(t, text, head_dim, bool(_get(text, "attention_bias", False)))
        elif kind == "mlp":
            inter = int(text["intermediate_size"])
            t.linear(hidden, inter, bias=bias)
            t.linear(inter, hidden, bias=bias)
        else:
            experts = int(text["n_routed_experts"])
            t.tensor(hidden * experts, experts, elem=FP32)
            t.experts(experts, hidden, int(text["moe_intermediate_size"]), gated=False)
            shared = int(_get(text, "moe_shared_expert_intermediate_size", 0)) * int(
                _get(text, "n_shared_experts", 0))
            if shared:
                t.linear(hidden, shared, bias=bias)
                t.linear(shared, hidden, bias=bias)
        t.tensor(hidden)
    t.tensor(hidden)
    _lm_head(t, text)


def _granite_hybrid(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/granitemoehybrid.py``: a Mamba-2 mixer or an attention block (rope only when
    ``position_embedding_type`` is ``rope``; head dim hidden / heads), then the MoE (router,
    gated experts) and the shared MLP, two norms; a tied head is allocated, then replaced by the
    embedding. Absent keys take ``configs/granitemoehybrid.py``'s defaults (``nope``, tied,
    ``shared_intermediate_size`` 8192, no experts)."""
    hidden = int(text["hidden_size"])
    m = mamba2_params(text, "GraniteMoeHybridForCausalLM", int(text["hidden_size"]))
    experts = int(_get(text, "num_local_experts", 0))
    shared = int(_get(text, "shared_intermediate_size", 8192))  # the config class's defaults
    _embed(t, text)
    for kind in kinds:
        if kind == "mamba":
            mamba2_mixer(t, hidden, m)
        else:
            _qkv_o(t, text, head_dim, bool(_get(text, "attention_bias", False)))
            if _get(text, "position_embedding_type", "nope") == "rope":
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
    if bool(_get(text, "tie_word_embeddings", True)):
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
    experts = int(_get(text, "n_routed_experts", 0))
    dense_k = int(_get(text, "first_k_dense_replace", 0))
    freq = int(_get(text, "moe_layer_freq", 1))
    _embed(t, text)
    for layer in range(len(kinds)):
        _deepseek_layer(t, text, bool(experts and layer >= dense_k and layer % freq == 0))
    t.tensor(int(text["hidden_size"]))
    _lm_head(t, text)
    for _ in kinds:
        t.tensor(heads * nope * kv_lora, heads * v_dim * kv_lora, elem=2)


def _deepseek_layer(t: Trace, text: Mapping[str, Any], sparse: bool) -> None:
    """One ``DeepseekV2DecoderLayer``: MLA, then the MoE block or the dense MLP, two norms."""
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    nope, rope_dim = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"])
    v_dim, kv_lora = int(text["v_head_dim"]), int(text["kv_lora_rank"])
    q_lora = _get(text, "q_lora_rank")
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
        if _get(text, "topk_method") == "noaux_tc":
            t.tensor(experts, elem=FP32)
        t.experts(experts, hidden, int(text["moe_intermediate_size"]))
        shared = int(_get(text, "n_shared_experts", 0)) * int(text["moe_intermediate_size"])
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
    layers = int(_get(text, "num_nextn_predict_layers", 0))
    if not layers:
        return 0
    t = Trace(_dtype_bytes(text), fp8_block=_fp8_block(text, top))
    hidden, vocab = int(text["hidden_size"]), padded_vocab(int(text["vocab_size"]))
    for _ in range(layers):
        _deepseek_layer(t, text, bool(_get(text, "n_routed_experts", 0)))
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
    experts = int(_get(text, "num_local_experts", 0))
    bias = bool(_get(text, "attention_bias", True))
    _embed(t, text)
    for _ in kinds:
        kv_heads = int(_get(text, "num_key_value_heads", heads))
        t.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
        t.tensor(heads)
        t.linear(heads * head_dim, hidden, bias=bias)
        t.rope(*rope_shape(text, head_dim))
        t.experts(experts, hidden, int(text["intermediate_size"]), bias=True)
        t.tensor(hidden * experts, experts)
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    _lm_head(t, text)


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


def _gemma3(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int,
            vision: Mapping[str, Any] | None = None) -> None:
    """``models/gemma3_causal.py``: an unpadded ``nn.Embedding``; per layer ``qkv_proj``,
    ``o_proj``, one rope per base (``rope_local_base_freq`` on sliding layers, ``rope_theta``
    on global ones, both with default scaling), ``q_norm``/``k_norm``, the gated MLP and four
    norms; the head is tied by default."""
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    # Gemma3TextConfig's defaults where the text config leaves them out.
    positions = int(_get(text, "max_position_embeddings", 131072))
    if vision is not None:
        _siglip(t, vision, hidden)
    _embed(t, text, pad=False)
    pattern = int(_get(text, "sliding_window_pattern", 6))
    for layer in range(len(kinds)):
        _qkv_o(t, text, head_dim, bool(_get(text, "attention_bias", False)))
        sliding = (layer + 1) % pattern != 0
        base = _get(text, "rope_local_base_freq", 10000.0) if sliding else _get(
            text, "rope_theta", 1000000.0)
        t.rope(positions, head_dim, float(base))
        t.tensor(head_dim, head_dim)
        t.linear(hidden, 2 * inter)
        t.linear(inter, hidden)
        t.tensor(hidden, hidden, hidden, hidden)
    t.tensor(hidden)
    _lm_head(t, text, tied_default=True)


def runtime_extra_bytes(arch: str, text: Mapping[str, Any]) -> int:
    """What SGLang allocates beyond the checkpoint's tensors and one rope cache (added to an
    index's ``total_size``): MLA's ``w_kc``/``w_vc`` copies and the DeepSeek-YaRN rope's two
    extra tables (``_deepseek``), Gemma-3's second rope base, Falcon-H1's float32 head (the
    checkpoint's is bf16)."""
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        heads, kv_lora = int(text["num_attention_heads"]), int(text["kv_lora_rank"])
        # DeepseekV2Config's defaults where a key is absent (128 each).
        nope, v_dim = int(_get(text, "qk_nope_head_dim", 128)), int(_get(text, "v_head_dim", 128))
        copies = heads * (nope + v_dim) * kv_lora * 2
        positions, rotary = rope_shape(text, int(text["qk_rope_head_dim"]))
        return int(text["num_hidden_layers"]) * copies + 2 * positions * rotary * FP32
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        head_dim = int(_get(text, "head_dim", 256))
        return int(_get(text, "max_position_embeddings", 8192)) * head_dim * FP32
    if arch == "FalconH1ForCausalLM":
        return padded_vocab(int(text["vocab_size"])) * int(text["hidden_size"]) * (
            FP32 - _dtype_bytes(text))
    return 0


def _olmoe(t: Trace, text: Mapping[str, Any], kinds: list[str], head_dim: int) -> None:
    """``models/olmoe.py``: ``qkv_proj``, ``q_norm`` and ``k_norm`` over the whole hidden size,
    ``o_proj``, the rope; the router and the gated experts of width ``intermediate_size``; two
    norms."""
    hidden = int(text["hidden_size"])
    experts = int(_get(text, "num_experts", 0))
    _embed(t, text)
    for _ in kinds:
        heads = int(text["num_attention_heads"])
        kv_heads = int(_get(text, "num_key_value_heads", heads))
        t.linear(hidden, (heads + 2 * kv_heads) * head_dim)
        t.tensor(hidden, hidden)
        t.linear(heads * head_dim, hidden)
        t.rope(*rope_shape(text, head_dim))
        t.tensor(hidden * experts)
        t.experts(experts, hidden, int(text["intermediate_size"]))
        t.tensor(hidden, hidden)
    t.tensor(hidden)
    _lm_head(t, text)


FAMILY_TRACERS = {
    "FalconH1ForCausalLM": _falcon_h1,
    "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_hybrid,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "GptOssForCausalLM": _gpt_oss,
    "Gemma3ForCausalLM": _gemma3,
    "Gemma3ForConditionalGeneration": _gemma3,
    "OlmoeForCausalLM": _olmoe,
}


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
