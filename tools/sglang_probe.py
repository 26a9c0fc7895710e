"""Can this machine's Python start SGLang's server? Import what the server path needs, one by one.

Run on the GPU machine with the carried site first on PYTHONPATH (tools/sglang_site.sh builds
it): prints torch's and SGLang's versions, then ``OK`` or ``FAIL`` with the exception's last
line for each module, kernels first (sgl_kernel loads its compiled ops against the machine's
libtorch at import). Exit status: the number of failures.

    python3 tools/sglang_probe.py
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from importlib import metadata

MODULES = (
    "torch", "triton", "transformers", "sgl_kernel", "flashinfer", "xgrammar", "tvm_ffi",
    "sglang", "sglang.srt.server_args", "sglang.srt.utils", "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3_5",
    "sglang.srt.models.qwen3_5_mtp", "sglang.launch_server",
    # SGLang's offline benchmark CLI: here in 0.5.11, under sglang.benchmark in 0.5.23.
    "sglang.bench_offline_throughput", "sglang.benchmark.offline_throughput",
)


def version(name: str) -> str:
    """An installed distribution's version, or what went wrong."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    """Import each module; print one line each; return the failures."""
    print(f"python {sys.version.split()[0]}; " + "; ".join(
        f"{n} {version(n)}" for n in ("torch", "sglang", "sglang-kernel", "transformers",
                                      "flashinfer-python", "xgrammar", "apache-tvm-ffi")))
    failed = 0
    for name in MODULES:
        t0 = time.monotonic()
        try:
            mod = importlib.import_module(name)
            if name == "sgl_kernel":  # the compiled ops load lazily on some releases
                import torch
                ops = getattr(torch.ops, "sgl_kernel", None)
                print(f"   sgl_kernel ops namespace: {ops is not None}; file {mod.__file__}")
            print(f"OK   {name} ({time.monotonic() - t0:.1f} s)")
        except BaseException as exc:  # noqa: BLE001 - every failure is the finding
            failed += 1
            # The whole message: a loader's error names the missing symbol at its end.
            last = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            cause = exc.__cause__ or exc.__context__
            if cause is not None:
                last += " | caused by: " + "".join(
                    traceback.format_exception_only(type(cause), cause)).strip()
            print(f"FAIL {name}: {last[:4000]}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
