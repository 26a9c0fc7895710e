"""The tuner reads the right GPU inside a container, where NVML sees only index 0."""

from __future__ import annotations

import pytest

from workers.tune import gpu


def test_nvml_index_follows_the_pinned_cuda_device(monkeypatch):
    monkeypatch.delenv("FLEET_CUDA_DEVICE", raising=False)
    assert gpu.nvml_index(3) == 3
    monkeypatch.setenv("FLEET_CUDA_DEVICE", "0")  # what docker-compose.yml sets for gpuN
    assert gpu.nvml_index(3) == 0
    monkeypatch.setenv("FLEET_CUDA_DEVICE", "0,1")  # not one device: the index stands
    assert gpu.nvml_index(3) == 3


def _visible_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: nothing to read here
        return 0


@pytest.mark.skipif(_visible_gpus() == 0, reason="needs a GPU that NVML can read")
def test_a_host_index_past_the_visible_gpus_reads_the_pinned_one(monkeypatch):
    """As in a container: the host index (here one past the last visible GPU) is not an NVML
    index; with FLEET_CUDA_DEVICE=0 the section is read and keeps the fleet's index."""
    host_index = _visible_gpus()
    monkeypatch.delenv("FLEET_CUDA_DEVICE", raising=False)
    section, reason = gpu.read_section(host_index)
    assert section is None and "not present" in (reason or "")
    monkeypatch.setenv("FLEET_CUDA_DEVICE", "0")
    section, reason = gpu.read_section(host_index)
    assert section is not None, reason
    assert section["index"] == host_index and section["memory_total_mib"] > 0
