"""The pieces every weights count is built of: a model's GPU allocations in construction order
(:class:`Trace`, segments by :mod:`workers.engine.allocator`), the rope cache, the vocabulary
padding, the quantization a config names, and the layers several families share (embedding,
head, attention projections, SGLang 0.5.11's ``MambaMixer2``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engine.allocator import reserved_bytes

# The KV pool and the weights count bytes per element of these dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


FP32 = 4


def cfg_get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``cfg[key]``, or ``default`` where it is absent or null."""
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
    rope = cfg_get(text, "rope_scaling") or cfg_get(text, "rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", cfg_get(text, "partial_rotary_factor", 1.0)))
    positions = int(cfg_get(text, "max_position_embeddings", 8192))
    if rope.get("rope_type", rope.get("type")) == "yarn":
        original = int(rope.get("original_max_position_embeddings", positions))
        positions = int(original * float(rope.get("factor", 1.0)))
    return positions, int(head_dim * factor)


def rope_buffer_bytes(text: Mapping[str, Any], head_dim: int) -> int:
    """Bytes of the text model's ``cos_sin_cache``."""
    positions, rotary_dim = rope_shape(text, head_dim)
    return positions * rotary_dim * FP32


def dtype_bytes(text: Mapping[str, Any]) -> int:
    return DTYPE_BYTES.get(str(cfg_get(text, "torch_dtype", cfg_get(text, "dtype", "bfloat16"))), 2)


VOCAB_PADDING = 64  # layers/vocab_parallel_embedding.py::DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab: int) -> int:
    """``pad_vocab_size``: ``VocabParallelEmbedding`` and ``ParallelLMHead`` round the vocabulary
    up to a multiple of 64."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


# The quantizations trace_model counts (none, fp8 with block scales, mxfp4 experts).
COUNTED_QUANT_METHODS = frozenset({"", "fp8", "mxfp4"})


def quant_method(text: Mapping[str, Any], top: Mapping[str, Any]) -> str:
    """The ``quant_method`` of the config's ``quantization_config`` ("" without one)."""
    quant = cfg_get(text, "quantization_config", cfg_get(top, "quantization_config"))
    return str(quant.get("quant_method", "")) if isinstance(quant, Mapping) else ""


def fp8_block(text: Mapping[str, Any], top: Mapping[str, Any]) -> int:
    """The block of an ``fp8`` checkpoint's ``quantization_config`` (DeepSeek-V3: 128), else 0."""
    quant = cfg_get(text, "quantization_config", cfg_get(top, "quantization_config"))
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return 0
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0])


def embed(t: Trace, text: Mapping[str, Any], pad: bool = True) -> int:
    """``embed_tokens``: [padded vocab, hidden]; returns its event index."""
    vocab = int(text["vocab_size"])
    index = len(t.events)
    t.tensor((padded_vocab(vocab) if pad else vocab) * int(text["hidden_size"]))
    return index


def lm_head(t: Trace, text: Mapping[str, Any], tied_default: bool = False) -> None:
    """``ParallelLMHead`` unless ``tie_word_embeddings`` (then the embedding is reused)."""
    if not bool(cfg_get(text, "tie_word_embeddings", tied_default)):
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


def qkv_o(t: Trace, text: Mapping[str, Any], head_dim: int, bias: bool = False) -> None:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(cfg_get(text, "num_key_value_heads", heads))
    t.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
    t.linear(heads * head_dim, hidden, bias=bias)
