"""The GPU section of a snapshot, read from NVML (nvidia-ml-py) for one GPU index or a group.

Reading is two steps: :func:`read_raw` copies what NVML returns (bytes, milliwatts) into a
plain dict, the same shape as the captures in ``tests/fixtures/tune/``; :func:`to_section`
turns that into MiB / W / % values. Only :func:`read_raw` touches the driver, so the
conversion is tested on real captures on machines without a GPU.

Memory: NVML's v2 ``used`` excludes the driver's reserved memory and equals nvidia-smi's
``memory.used``; v1 ``used`` includes it (NVML's ``nvmlDeviceGetMemoryInfo`` and its v2 form;
both are in the captures of tests/fixtures/tune/nvml/). We report v2
when the driver has it. NVML indices follow PCI bus order, so an engine pinned with
``CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=N`` shows up on index N. Inside a
container that reserves one GPU, NVML sees only that one, as index 0, whatever its host index:
there ``FLEET_CUDA_DEVICE`` (the engine's ``CUDA_VISIBLE_DEVICES``, 0) is the NVML index.

A GPU group (one tensor-parallel engine on GPUs 0 and 1, say) is read GPU by GPU: the section
is that of the group's GPU with the least free memory, the one that binds (SGLang's
``get_available_gpu_memory(..., distributed=True)`` takes the minimum over the TP ranks), and
its ``group`` lists every GPU's section (memory and utilisation of each). A container that
reserves the group's GPUs sees them as 0..k-1 (``FLEET_CUDA_DEVICE=0,1``).

This module imports only the standard library and pynvml, so it also runs as a script
(``python workers/tune/gpu.py 0 1``) on machines that have nothing else installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

MIB = 1024 * 1024

RawGpu = dict[str, Any]
GpuSection = dict[str, Any]


class GpuUnavailable(RuntimeError):
    """NVML cannot be loaded or the GPU index does not exist."""


def _optional(fn: Callable[..., Any], *args: Any) -> Any:
    """Call an NVML getter that some drivers and containers do not support; None if it fails."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _memory(handle: Any) -> tuple[dict[str, int] | None, dict[str, int] | None]:
    import pynvml

    v1 = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
    v2 = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
    v1_dict = None if v1 is None else {"total": v1.total, "used": v1.used, "free": v1.free}
    v2_dict = None
    if v2 is not None:
        v2_dict = {"total": v2.total, "used": v2.used, "free": v2.free, "reserved": v2.reserved}
    return v1_dict, v2_dict


def _processes(handle: Any) -> list[dict[str, Any]]:
    import pynvml

    procs = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return [{"pid": p.pid, "used_gpu_memory": p.usedGpuMemory} for p in procs]


def _device_raw(handle: Any, index: int) -> RawGpu:
    import pynvml

    v1, v2 = _memory(handle)
    util = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    pci = _optional(pynvml.nvmlDeviceGetPciInfo, handle)
    return {
        "index": index,
        "name": _text(_optional(pynvml.nvmlDeviceGetName, handle)),
        "uuid": _text(_optional(pynvml.nvmlDeviceGetUUID, handle)),
        "pci_bus_id": None if pci is None else _text(pci.busId),
        "memory_v1": v1,
        "memory_v2": v2,
        "utilization": {} if util is None else {"gpu": util.gpu, "memory": util.memory},
        "power_mw": _optional(pynvml.nvmlDeviceGetPowerUsage, handle),
        "power_limit_mw": _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle),
        "temperature_c": _optional(
            pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        ),
        "compute_processes": _processes(handle),
    }


def nvml_index(index: int) -> int:
    """The NVML index of the fleet's GPU ``index``: ``FLEET_CUDA_DEVICE`` when it names one
    device (a container's GPU is device 0), else ``index`` itself."""
    pinned = os.environ.get("FLEET_CUDA_DEVICE", "").strip()
    return int(pinned) if pinned.isdigit() else index


def nvml_indices(gpus: Sequence[int]) -> list[int]:
    """The NVML indices of a GPU group: ``FLEET_CUDA_DEVICE`` when it lists one device per GPU
    of the group (a container's devices 0..k-1), else the fleet's own indices."""
    pinned = [p.strip() for p in os.environ.get("FLEET_CUDA_DEVICE", "").split(",") if p.strip()]
    if len(pinned) == len(gpus) and all(p.isdigit() for p in pinned):
        return [int(p) for p in pinned]
    return list(gpus)


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """pynvml, initialised for the block and shut down after; GpuUnavailable when it cannot
    be loaded or initialised."""
    try:
        import pynvml
    except ImportError as exc:
        raise GpuUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GpuUnavailable(f"NVML unavailable: {exc}") from exc
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def device_count() -> int:
    """How many GPUs NVML sees on this node (in a container: those it was given); raises
    GpuUnavailable when NVML cannot be loaded."""
    with _nvml() as pynvml:
        try:
            return int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML error: {exc}") from exc


def read_raw(index: int, nvml: int | None = None) -> RawGpu:
    """Raw NVML readings for GPU ``index`` (at NVML index ``nvml``, default
    :func:`nvml_index`) plus the driver version; raises GpuUnavailable."""
    fleet_index, index = index, nvml_index(index) if nvml is None else nvml
    with _nvml() as pynvml:
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise GpuUnavailable(f"GPU index {index} not present (NVML sees {count} GPUs)")
            raw = _device_raw(pynvml.nvmlDeviceGetHandleByIndex(index), fleet_index)
            raw["driver"] = _text(_optional(pynvml.nvmlSystemGetDriverVersion))
            return raw
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML error on GPU {index}: {exc}") from exc


def _mib(value: int | None) -> int | None:
    # Rounded up, as nvidia-smi prints them (21006.8 -> 21007 used, 122149.1 -> 122150 free).
    return None if value is None else math.ceil(value / MIB)


def _memory_mib(raw: RawGpu) -> dict[str, int | None]:
    v2 = raw.get("memory_v2")
    v1 = raw.get("memory_v1") or {}
    if v2:
        return {
            "memory_total_mib": _mib(v2["total"]),
            "memory_used_mib": _mib(v2["used"]),
            "memory_free_mib": _mib(v2["free"]),
            "memory_reserved_mib": _mib(v2.get("reserved")),
        }
    return {
        "memory_total_mib": _mib(v1.get("total")),
        "memory_used_mib": _mib(v1.get("used")),
        "memory_free_mib": _mib(v1.get("free")),
        "memory_reserved_mib": None,
    }


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else round(milliwatts / 1000, 1)


def to_section(raw: RawGpu) -> GpuSection:
    """Convert raw NVML readings into the snapshot's ``gpu`` section (MiB, W, %)."""
    util = raw.get("utilization") or {}
    processes = [
        {"pid": p["pid"], "used_memory_mib": _mib(p.get("used_gpu_memory"))}
        for p in raw.get("compute_processes") or []
    ]
    return {
        "index": raw["index"],
        "name": raw.get("name"),
        "uuid": raw.get("uuid"),
        "pci_bus_id": raw.get("pci_bus_id"),
        "driver": raw.get("driver"),
        **_memory_mib(raw),
        "utilization_gpu_pct": util.get("gpu"),
        "utilization_memory_pct": util.get("memory"),
        "power_w": _watts(raw.get("power_mw")),
        "power_limit_w": _watts(raw.get("power_limit_mw")),
        "temperature_c": raw.get("temperature_c"),
        "processes": processes,
    }


def read_section(index: int) -> tuple[GpuSection | None, str | None]:
    """The ``gpu`` section for GPU ``index``, or (None, reason) where NVML cannot read it."""
    try:
        return to_section(read_raw(index)), None
    except GpuUnavailable as exc:
        return None, str(exc)


def to_group_section(raws: Sequence[RawGpu]) -> GpuSection:
    """The ``gpu`` section of a group from each GPU's raw readings: the binding GPU's section
    (least free memory) with ``group`` listing every GPU's; one GPU gives its plain section."""
    sections = [to_section(raw) for raw in raws]
    if len(sections) == 1:
        return sections[0]
    binding = min(sections, key=lambda s: (s["memory_free_mib"] is None,
                                           s["memory_free_mib"] or 0))
    return {**binding, "group": sections}


def read_group_section(gpus: Sequence[int]) -> tuple[GpuSection | None, str | None]:
    """The ``gpu`` section for a GPU group (every GPU read), or (None, reason) where NVML
    cannot read one of them."""
    if len(gpus) == 1:
        return read_section(gpus[0])
    try:
        raws = [read_raw(g, n) for g, n in zip(gpus, nvml_indices(gpus), strict=True)]
    except GpuUnavailable as exc:
        return None, str(exc)
    return to_group_section(raws), None


def main(argv: list[str]) -> int:
    """Print raw readings and sections for the GPU indices in ``argv`` as JSON."""
    out: dict[str, Any] = {}
    for arg in argv or ["0"]:
        try:
            raw = read_raw(int(arg))
            out[arg] = {"raw": raw, "section": to_section(raw)}
        except GpuUnavailable as exc:
            out[arg] = {"error": str(exc)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
