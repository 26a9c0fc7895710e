"""What SGLang keeps off the static pool for a model class: the VLM factor, the prefill CUDA
graphs a release keeps, and the GPU memory a multimodal model's tokenizer takes before ``pre``.

Pure functions of the model's shape and the flags; :mod:`workers.engine.server_args` and
:mod:`workers.engine.capacity` call them with the release's traits. Read from the wheels:
``server_args.py`` (``adjust_mem_fraction_for_vlm``, ``_handle_piecewise_cuda_graph`` through
0.5.11; ``_apply_cuda_graph_compatibility`` and ``reserve_for_graph_mb`` in 0.5.17) and
``configs/model_config.py`` (the architecture lists).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.engine_flags import EngineFlags
    from workers.engine.model_config import ModelShape

# 0.5.17 configs/model_config.py::multimodal_breakable_cuda_graph_supported_model_archs and
# multimodal_piecewise_cuda_graph_supported_model_archs: the multimodal architectures whose
# language-model prefill keeps a captured graph (breakable, or moved to tc_piecewise).
MM_BREAKABLE_ARCHS = frozenset({"Qwen3_5ForConditionalGeneration",
                                "Qwen3_5MoeForConditionalGeneration"})
MM_PIECEWISE_ARCHS = frozenset({"Cohere2VisionForConditionalGeneration",
                                "KimiK25ForConditionalGeneration",
                                "MiniMaxM3SparseForCausalLM",
                                "MiniMaxM3SparseForConditionalGeneration"})
# 0.5.17 configs/model_config.py::is_nemotron_h (its Mamba-2 prefill is not BCG-safe).
NEMOTRON_H_ARCHS = frozenset({"NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
                              "NemotronHForCausalLMMTP"})
# A bare CUDA context of one more process on the H200 (driver 580.159, CUDA 13): free memory
# fell 21,007 MiB for a process holding 20 GiB and 31,247 MiB for one holding 30 GiB
# (tests/fixtures/tune/nvml/shared_h200x2_capture.json), 527 MiB over what each allocated.
# A property of the driver and runtime, as capacity.STARTUP_USED_GIB is.
PROCESS_CONTEXT_MIB = 527


def vlm_mem_factor(vision: tuple[int, int] | None) -> float:
    """``ServerArgs.adjust_mem_fraction_for_vlm``: ``0.95 * clamp(1 - 0.1 * (layers * hidden^2
    / (24 * 1024^2) - 1), 0.8, 1.05)``, the ViT's weight count against a ViT-L/14."""
    if vision is None:
        return 1.0
    layers, hidden = vision
    ratio = layers * hidden**2 / (24 * 1024**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """``_generate_piecewise_cuda_graph_tokens`` (0.5.17:
    ``_generate_prefill_cuda_graph_batch_sizes``): the prefill sizes captured up to max_tokens."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return [s for s in sizes if s <= max_tokens]


def piecewise_prefill_graphs(flags: EngineFlags, shape: ModelShape | None) -> bool:
    """Through 0.5.16 (``_handle_piecewise_cuda_graph``): piecewise graphs stay on unless the
    architecture is listed, the model is multimodal or torch.compile is on; ``--enforce-…``
    wins."""
    if flags.enforce_piecewise_cuda_graph:
        return True
    if flags.disable_piecewise_cuda_graph or flags.enable_torch_compile:
        return False
    return shape is None or not (shape.piecewise_cuda_graph_disabled or shape.multimodal)


def breakable_prefill_graphs(flags: EngineFlags, shape: ModelShape | None) -> bool:
    """0.5.17 ``ServerArgs._apply_cuda_graph_compatibility``: the prefill backend defaults to
    ``breakable``; ``--disable-piecewise-cuda-graph`` / ``--enforce-…`` set it (disabled /
    tc_piecewise) and skip the rules. A multimodal architecture on the piecewise list moves to
    tc_piecewise, whose rules (``_disable_tc_piecewise_cudagraph_if_incompatible``) drop the
    listed architectures and torch.compile; breakable
    (``_disable_breakable_cudagraph_if_incompatible``) drops MLA other than DSA, Nemotron-H
    and multimodal architectures not on its list."""
    if flags.disable_piecewise_cuda_graph or flags.disable_cuda_graph:
        return False  # _resolve_cuda_graph_config: --disable-cuda-graph turns off both phases
    if flags.enforce_piecewise_cuda_graph or shape is None:
        return True
    if shape.multimodal and shape.architecture in MM_PIECEWISE_ARCHS:
        return not (shape.piecewise_cuda_graph_disabled or flags.enable_torch_compile)
    if shape.mla and not shape.dsa:
        return False
    if shape.architecture in NEMOTRON_H_ARCHS:
        return False
    return not shape.multimodal or shape.architecture in MM_BREAKABLE_ARCHS


def tokenizer_gpu_mib(flags: EngineFlags, shape: ModelShape, pool_mib: int) -> float:
    """GPU memory the tokenizer process holds on GPU 0 before the scheduler measures ``pre``.

    0.5.17 ``ServerArgs._handle_multimodal_feature_transport``: unset ``--mm-feature-transport``
    resolves to ``cuda_ipc`` on single-node CUDA, and the multimodal processor
    (``multimodal/processors/base_processor.py``, ``MmItemMemoryPool``) allocates
    ``SGLANG_MM_FEATURE_CACHE_MB`` (``pool_mib``) there, in its own process: the pool plus that
    process's CUDA context. 0 for a text model, ``cpu`` transport or a release without it.
    """
    if not pool_mib or not shape.multimodal or flags.mm_feature_transport == "cpu":
        return 0.0
    return pool_mib + PROCESS_CONTEXT_MIB


def decode_graph_reserve_mib(flags: EngineFlags, graph_bs: int, by_phase: bool) -> float:
    """The decode graphs' share of the reserve: ``cuda_graph_max_bs * 2`` MiB, always through
    0.5.16 (``_handle_gpu_memory_settings``); from 0.5.17 (``by_phase``,
    ``reserve_for_graph_mb``) only while the decode backend is on, which
    ``--disable-cuda-graph`` turns off."""
    if by_phase and flags.disable_cuda_graph:
        return 0.0
    return graph_bs * 2.0
