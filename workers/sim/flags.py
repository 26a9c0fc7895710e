"""A vendored subset of SGLang 0.5.11's command-line flags (``ServerArgs.add_cli_args``).

The simulator is launched with exactly the argv of ``python -m sglang.launch_server``, so it
parses the same flags and, like SGLang, exits with argparse's status 2 on an unknown flag. This is
a hand-written subset (the flags a launch profile of this fleet may carry, with their SGLang
defaults and choices), not the full ~355-action schema; a flag missing here is rejected, which
errs on the side of catching typos before a real GPU launch does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from workers.engine.capacity import parse_human_int


def human_readable_int(value: str) -> int:
    """SGLang's ``human_readable_int``: ``32k``, ``1M``, ``128Ki`` or a plain integer."""
    try:
        return parse_human_int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from exc


BOOL = "bool"  # store_true
# (option strings, type or BOOL, default, choices); dest = first option without dashes, as in
# ServerArgs (``--tp-size`` -> ``tp_size``, the field ``from_cli_args`` maps it back to).
FlagSpec = tuple[tuple[str, ...], "Callable[[str], Any] | str", Any, Sequence[str] | None]

_MODEL: list[FlagSpec] = [
    (("--model-path", "--model"), str, None, None),
    (("--tokenizer-path",), str, None, None),
    (("--tokenizer-mode",), str, "auto", ("auto", "slow")),
    (("--tokenizer-worker-num",), int, 1, None),
    (("--skip-tokenizer-init",), BOOL, False, None),
    (("--load-format",), str, "auto", None),
    (("--trust-remote-code",), BOOL, False, None),
    (("--dtype",), str, "auto", None),
    (
        ("--kv-cache-dtype",),
        str,
        "auto",
        ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"),
    ),
    (("--quantization",), str, None, None),
    (("--context-length",), int, None, None),
    (("--device",), str, None, None),
    (("--served-model-name",), str, None, None),
    (("--chat-template",), str, None, None),
    (("--revision",), str, None, None),
    (("--is-embedding",), BOOL, False, None),
    (("--enable-multimodal",), BOOL, None, None),
    (("--json-model-override-args",), str, "{}", None),
    (("--preferred-sampling-params",), str, None, None),
    (("--weight-version",), str, "default", None),
    (("--random-seed",), int, None, None),
]

_HTTP: list[FlagSpec] = [
    (("--host",), str, "127.0.0.1", None),
    (("--port",), int, 30000, None),
    (("--skip-server-warmup",), BOOL, False, None),
    (("--api-key",), str, None, None),
    (("--log-level",), str, "info", None),
    (("--log-level-http",), str, None, None),
    (("--log-requests",), BOOL, False, None),
    (("--log-requests-level",), int, 2, ("0", "1", "2", "3")),
    (("--enable-metrics",), BOOL, False, None),
    (("--enable-metrics-for-all-schedulers",), BOOL, False, None),
    (("--extra-metric-labels",), str, None, None),
    (("--collect-tokens-histogram",), BOOL, False, None),
    (("--decode-log-interval",), int, 40, None),
    (("--enable-cache-report",), BOOL, False, None),
    (("--reasoning-parser",), str, None, None),
    (("--tool-call-parser",), str, None, None),
    (("--allow-auto-truncate",), BOOL, False, None),
    (("--incremental-streaming-output",), BOOL, False, None),
    (("--stream-interval",), int, 1, None),
    (("--watchdog-timeout",), float, 300.0, None),
    (("--show-time-cost",), BOOL, False, None),
    (("--crash-dump-folder",), str, None, None),
    (("--enable-request-time-stats-logging",), BOOL, False, None),
]

_SCHEDULING: list[FlagSpec] = [
    (("--mem-fraction-static",), float, None, None),
    (("--max-running-requests",), int, None, None),
    (("--max-queued-requests",), int, None, None),
    (("--max-total-tokens",), human_readable_int, None, None),
    # type=int in server_args.py (only --max-total-tokens takes human_readable_int there).
    (("--chunked-prefill-size",), int, None, None),
    (("--max-prefill-tokens",), int, 16384, None),
    (
        ("--schedule-policy",),
        str,
        "fcfs",
        ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key"),
    ),
    (("--schedule-conservativeness",), float, 1.0, None),
    (("--enable-priority-scheduling",), BOOL, False, None),
    (("--page-size",), int, None, None),
    (("--num-continuous-decode-steps",), int, 1, None),
    (("--cpu-offload-gb",), int, 0, None),
    (("--enable-mixed-chunk",), BOOL, False, None),
    (("--disable-radix-cache",), BOOL, False, None),
    (("--disable-overlap-schedule",), BOOL, False, None),
    (("--disable-cuda-graph",), BOOL, False, None),
    (("--disable-cuda-graph-padding",), BOOL, False, None),
    (("--disable-piecewise-cuda-graph",), BOOL, False, None),  # 0.5.11 ServerArgs
    (("--cuda-graph-max-bs",), int, None, None),
    (("--enable-torch-compile",), BOOL, False, None),
    (("--torch-compile-max-bs",), int, 32, None),
    (("--attention-backend",), str, None, None),
    (("--prefill-attention-backend",), str, None, None),
    (("--decode-attention-backend",), str, None, None),
    (("--sampling-backend",), str, None, None),
    (("--mm-attention-backend",), str, None, None),
    (("--grammar-backend",), str, None, None),
    (("--enable-deterministic-inference",), BOOL, False, None),
    (("--enable-hierarchical-cache",), BOOL, False, None),
    (("--hicache-ratio",), float, 2.0, None),
    (("--enable-lora",), BOOL, None, None),
    (("--max-loras-per-batch",), int, 8, None),
]

_PARALLEL: list[FlagSpec] = [
    (("--tp-size", "--tensor-parallel-size"), int, 1, None),
    (("--dp-size", "--data-parallel-size"), int, 1, None),
    (("--pp-size", "--pipeline-parallel-size"), int, 1, None),
    (("--ep-size", "--expert-parallel-size"), int, 1, None),
    (("--enable-dp-attention",), BOOL, False, None),
    (
        ("--load-balance-method",),
        str,
        "auto",
        ("auto", "round_robin", "total_requests", "total_tokens"),
    ),
    (("--dist-init-addr",), str, None, None),
    (("--nnodes",), int, 1, None),
    (("--node-rank",), int, 0, None),
    (("--base-gpu-id",), int, 0, None),
    (("--gpu-id-step",), int, 1, None),
    (("--nccl-port",), int, None, None),
    (("--enable-p2p-check",), BOOL, False, None),
    (("--disable-custom-all-reduce",), BOOL, False, None),
]

_MAMBA_AND_SPEC: list[FlagSpec] = [
    (("--max-mamba-cache-size",), int, None, None),
    (("--mamba-full-memory-ratio",), float, 0.9, None),
    (
        # --mamba-radix-cache-strategy: its name from 0.5.14 (the old one gone in 0.5.20).
        ("--mamba-scheduler-strategy", "--mamba-radix-cache-strategy"),
        str,
        "auto",
        ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"),
    ),
    (("--mamba-ssm-dtype",), str, None, ("float32", "bfloat16", "float16")),
    (("--mamba-track-interval",), int, 256, None),
    (("--mamba-backend",), str, "triton", ("triton", "flashinfer")),
    (("--linear-attn-backend",), str, None, None),
    (("--linear-attn-decode-backend",), str, None, None),
    (("--linear-attn-prefill-backend",), str, None, None),
    (
        ("--speculative-algorithm",),
        str,
        None,
        ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH"),
    ),
    (
        ("--speculative-draft-model-path", "--speculative-draft-model"),
        str,
        None,
        None,
    ),
    (("--speculative-draft-model-revision",), str, None, None),
    (("--speculative-num-steps",), int, None, None),
    (("--speculative-eagle-topk",), int, None, None),
    (("--speculative-num-draft-tokens",), int, None, None),
    (("--speculative-accept-threshold-single",), float, 1.0, None),
    (("--speculative-accept-threshold-acc",), float, 1.0, None),
    (("--speculative-token-map",), str, None, None),
    (("--speculative-attention-mode",), str, "prefill", None),
]

FLAG_SPECS: list[FlagSpec] = _MODEL + _HTTP + _SCHEDULING + _PARALLEL + _MAMBA_AND_SPEC


def _add(parser: argparse.ArgumentParser, spec: FlagSpec) -> None:
    """Add one vendored flag to ``parser``."""
    options, kind, default, choices = spec
    dest = options[0].removeprefix("--").replace("-", "_")
    if kind == BOOL:
        parser.add_argument(*options, dest=dest, action="store_true", default=default)
        return
    convert = kind if callable(kind) else str
    if choices is not None and convert is int:
        choices = [int(c) for c in choices]
    parser.add_argument(*options, dest=dest, type=convert, default=default, choices=choices)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m workers.sim`` (SGLang's flags, subset)."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.sim",
        description="Simulated SGLang 0.5.11 server (CPU only; see workers/sim/__init__.py).",
    )
    for spec in FLAG_SPECS:
        _add(parser, spec)
    parser.add_argument("--cuda-graph-bs", dest="cuda_graph_bs", type=int, nargs="+", default=None)
    parser.add_argument("--lora-paths", dest="lora_paths", nargs="*", default=None)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse SGLang launch flags; exits with status 2 on an unknown or malformed flag."""
    args = build_parser().parse_args(argv)
    if args.model_path is None:
        build_parser().error("the following arguments are required: --model-path")
    if args.cuda_graph_bs and args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = max(args.cuda_graph_bs)  # a list sets max_bs = max(list)
    return args
