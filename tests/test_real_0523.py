"""SGLang 0.5.23 on the lent H200: what it answered (fixtures/sglang/0.5.23/real-h200).

It did not start: its kernel library needs torch 2.14.1's C++ symbols and the machine has torch
2.11.0. These tests keep the fleet's release table honest about that: the pins it records for
0.5.23 are the ones that failed there, the probe saw exactly those versions, and the missing
symbols are libtorch's (not a packaging slip of the payload). The 0.5.11 captures beside it
(tests/test_real_pools.py) are what a started release is checked against; once a node with
network starts 0.5.23, its captures go here and the pool checks follow.
"""

from __future__ import annotations

import re
from pathlib import Path

from workers.engine import releases

REAL = Path(__file__).parent / "fixtures" / "sglang" / "0.5.23" / "real-h200"


def probe() -> tuple[dict[str, str], dict[str, str]]:
    """(versions on the probe's first line, module -> OK/FAIL)."""
    lines = (REAL / "probe.log").read_text().splitlines()
    versions = dict(part.strip().rsplit(" ", 1) for part in lines[0].split(";"))
    status = {}
    for line in lines[1:]:
        m = re.match(r"^(OK|FAIL)\s+([\w.]+)", line)
        if m:
            status[m.group(2).rstrip(":")] = m.group(1)
    return versions, status


def test_the_probe_ran_the_pinned_release_on_the_machines_torch() -> None:
    versions, _ = probe()
    pins = releases.traits("0.5.23").pins
    assert versions["sglang"] == "0.5.23"
    assert versions["sglang-kernel"] == pins["sglang-kernel"] == "0.4.10"
    assert versions["transformers"] == pins["transformers"]
    assert versions["flashinfer-python"] == pins["flashinfer-python"]
    # The machine's torch is 0.5.11's pin, not 0.5.23's.
    assert versions["torch"] == releases.traits("0.5.11").pins["torch"] == "2.11.0"
    assert pins["torch"] == "2.14.1" != versions["torch"]


def test_the_kernel_library_is_what_does_not_load() -> None:
    _, status = probe()
    assert status["torch"] == status["transformers"] == status["sglang"] == "OK"
    assert status["sgl_kernel"] == "FAIL"
    server_path = ("sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server",
                   "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner",
                   "sglang.srt.models.qwen3_5")
    assert all(status[m] == "FAIL" for m in server_path)
    text = (REAL / "probe.log").read_text()
    assert text.count("Could not load any common_ops library") >= len(server_path)
    assert "sgl_kernel/sm90/common_ops.abi3.so" in text


def test_the_missing_symbols_are_libtorchs_cxx_api() -> None:
    rows = [ln.split("\t") for ln in (REAL / "missing_symbols.txt").read_text().splitlines()
            if ln and not ln.startswith("#")]
    needed, instead = rows[:3], rows[3:]
    assert all(mangled.startswith("_ZN3c10") for mangled, _ in needed)
    names = [demangled for _, demangled in needed]
    assert any("c10_cuda_check_implementation" in n and "CUDAErrorLogCapture*" in n
               for n in names)
    # torch 2.11.0 has the same function with one argument fewer.
    [(_, older)] = instead
    assert older.endswith("c10_cuda_check_implementation(int, char const*, char const*, "
                          "unsigned int, bool)")
