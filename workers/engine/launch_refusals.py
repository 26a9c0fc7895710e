"""Launches SGLang refuses at start, by rule: the ValueErrors of
``ServerArgs._handle_mamba_radix_cache`` (:func:`check_hybrid_flags`) and the assertions and
errors of :func:`known_refusals` (model-specific adjustments, the triton backend's layer-0 read,
gpt-oss's backends, TP divisibility), each cited; :func:`check_launch` raises the first as
:class:`LaunchRefused`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.server_args import EngineFlags, release, resolved_mamba_strategy, speculative

if TYPE_CHECKING:
    from workers.engine.model_config import ModelShape


def check_hybrid_flags(flags: EngineFlags) -> None:
    """Raise the ValueErrors ``ServerArgs._handle_mamba_radix_cache`` raises for hybrid models.

    ``extra_buffer`` with ``--disable-radix-cache``, and speculative decoding with the radix
    cache under ``no_buffer``. The conditions are SGLang's; the messages shortened.
    """
    # From 0.5.14 ``_handle_mamba_radix_cache`` returns first when the radix cache is off.
    early_return = release(flags).mamba_auto_strategy == "extra_buffer_if_overlap"
    buffered = flags.mamba_scheduler_strategy in ("extra_buffer", "extra_buffer_lazy")
    if buffered and flags.disable_radix_cache and not early_return:
        raise ValueError(
            "--mamba-scheduler-strategy extra_buffer requires the radix cache; it cannot be "
            "used with --disable-radix-cache (use no_buffer)."
        )
    if (
        speculative(flags)
        and not flags.disable_radix_cache
        and resolved_mamba_strategy(flags) == "no_buffer"
    ):
        raise ValueError(
            "Speculative decoding for hybrid (Mamba) models with radix cache requires "
            "--mamba-scheduler-strategy extra_buffer (or --disable-radix-cache)."
        )


# server_args.py::_handle_model_specific_adjustments: architectures whose branch calls
# _handle_mamba_radix_cache(support_mamba_cache_extra_buffer=False) through 0.5.13 (0.5.14 moves
# them into _support_mamba_cache_extra_buffer, EXTRA_BUFFER_ARCHITECTURES above).
NO_EXTRA_BUFFER_ARCHITECTURES = frozenset({
    "FalconH1ForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
    "JetNemotronForCausalLM", "JetVLMForConditionalGeneration", "Lfm2ForCausalLM",
})
# The same method asserts the attention backend is not triton for these (0.5.11: "does not
# support triton attention backend, as the first layer might not be an attention layer").
NO_TRITON_ARCHITECTURES = frozenset({"NemotronHForCausalLM", "Lfm2ForCausalLM"})
# TritonAttnBackend.__init__ reads the value buffer of layer 0 unless the model is a GDN, Kimi
# or linear-attention hybrid: a Mamba-2 hybrid whose first layer has no KV raises
# ``ValueError: layer_id=0 not in full attention layers`` (seen with Granite-4.0-H, 0.5.11).
MAMBA2_ARCHITECTURES = frozenset({"FalconH1ForCausalLM", "NemotronHForCausalLM",
                                  "GraniteMoeHybridForCausalLM"})
# The GptOssForCausalLM branch asserts prefill and decode backends are among these.
GPT_OSS_BACKENDS = frozenset({"triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_xpu",
                              "aiter"})


@dataclass(frozen=True)
class Refusal:
    """A launch SGLang rejects by rule before it serves: its words (shortened) and where."""

    message: str
    source: str  # the SGLang 0.5.11 file and function that raise it

    def __str__(self) -> str:
        return f"{self.message} (SGLang {self.source})"


class LaunchRefused(ValueError):
    """SGLang would refuse this launch (see :func:`known_refusals`)."""


def known_refusals(shape: ModelShape, flags: EngineFlags) -> list[Refusal]:
    """The rules by which SGLang 0.5.11 refuses ``flags`` for ``shape`` at start, each cited.

    Besides :func:`check_hybrid_flags` (``_handle_mamba_radix_cache``'s ValueErrors):

    - Nemotron-H (and LFM2) on ``--attention-backend triton``: an assertion in
      ``ServerArgs._handle_model_specific_adjustments`` (the ``NemotronHForCausalLM`` branch);
    - ``--mamba-scheduler-strategy extra_buffer`` on a hybrid whose branch passes
      ``support_mamba_cache_extra_buffer=False`` (Falcon-H1, Nemotron-H, Granite-4.0-H, JetNemotron,
      LFM2): the assertion at the top of ``_handle_mamba_radix_cache``, through 0.5.13;
    - gpt-oss on a prefill or decode backend outside its list (the ``GptOssForCausalLM`` branch);
    - ``--tp-size`` that does not divide the attention heads (``layers/linear.py::
      QKVParallelLinear``, ``divide``) or the Mamba heads (``configs/mamba_utils.py::
      Mamba2StateShape.create``, ``divide``), or KV heads and TP that divide neither way.
    """
    out: list[Refusal] = []
    arch = shape.architecture
    backend = flags.attention_backend
    if arch in NO_TRITON_ARCHITECTURES and backend == "triton":
        out.append(Refusal(f"{arch} does not support triton attention backend, as the first "
                           "layer might not be an attention layer",
                           "server_args.py::ServerArgs._handle_model_specific_adjustments"))
    if (arch in MAMBA2_ARCHITECTURES and arch not in NO_TRITON_ARCHITECTURES
            and backend == "triton"
            and shape.first_layer_kind not in ("attention", "parallel")):
        out.append(Refusal(f"layer_id=0 not in full attention layers: {arch} on the triton "
                           "attention backend, whose first layer is not an attention layer "
                           "(dies after its pools are allocated; use another backend)",
                           "layers/attention/triton_backend.py::TritonAttnBackend.__init__"))
    early_return = release(flags).mamba_auto_strategy == "extra_buffer_if_overlap"
    if (arch in NO_EXTRA_BUFFER_ARCHITECTURES and shape.hybrid and not early_return
            and flags.mamba_scheduler_strategy == "extra_buffer"):
        out.append(Refusal(f"mamba extra_buffer is not supported for {arch} model "
                           "(use --mamba-scheduler-strategy no_buffer or auto)",
                           "server_args.py::ServerArgs._handle_mamba_radix_cache"))
    if arch == "GptOssForCausalLM":
        chosen = {flags.prefill_attention_backend or backend,
                  flags.decode_attention_backend or backend} - {None}
        bad = sorted(b for b in chosen if b not in GPT_OSS_BACKENDS)  # type: ignore[misc]
        if bad:
            out.append(Refusal(f"GptOssForCausalLM requires one of {sorted(GPT_OSS_BACKENDS)} "
                               f"attention backend, but got {', '.join(bad)}",
                               "server_args.py::ServerArgs._handle_model_specific_adjustments"))
    tp = flags.tp_size
    heads = shape.attention_heads
    if tp > 1 and heads and heads % tp:
        out.append(Refusal(f"{heads} attention heads are not divisible by --tp-size {tp}",
                           "layers/linear.py::QKVParallelLinear (divide)"))
    kv = shape.kv_heads
    if tp > 1 and kv and kv % tp and tp % kv:
        out.append(Refusal(f"{kv} KV heads and --tp-size {tp}: neither divides the other",
                           "layers/linear.py::QKVParallelLinear (divide)"))
    if tp > 1 and shape.mamba_heads and shape.mamba_heads % tp:
        out.append(Refusal(f"{shape.mamba_heads} Mamba heads are not divisible by --tp-size {tp}",
                           "configs/mamba_utils.py::Mamba2StateShape.create (divide)"))
    return out


def check_launch(shape: ModelShape, flags: EngineFlags) -> None:
    """Raise :class:`LaunchRefused` naming every rule of :func:`known_refusals` that applies."""
    found = known_refusals(shape, flags)
    if found:
        raise LaunchRefused("SGLang refuses this launch: " + "; ".join(map(str, found)))
