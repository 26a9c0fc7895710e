"""The snapshot's GPU section: NVML readings converted, on real captures from H200 machines."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from workers.tune import gpu

FIXTURES = Path(__file__).parent / "fixtures" / "tune" / "nvml"
ROOT = Path(__file__).resolve().parents[1]


def _device_capture() -> dict:
    return json.loads((FIXTURES / "h200x2_pinned_gpu1.json").read_text())


def test_real_h200_capture_converts_to_mib_watts_and_percent_like_nvidia_smi():
    for captured in _device_capture().values():
        section = gpu.to_section(captured["raw"])
        for key in ("index", "name", "uuid", "pci_bus_id", "driver", "memory_total_mib"):
            assert section[key] == captured["section"][key]
    one = gpu.to_section(_device_capture()["1"]["raw"])
    assert one["name"] == "NVIDIA H200"
    assert one["memory_total_mib"] == 143771
    # NVML v2 "used" excludes the 615 MiB the driver reserves; nvidia-smi printed 12907 MiB.
    assert (one["memory_used_mib"], one["memory_reserved_mib"]) == (12907, 616)
    assert one["memory_free_mib"] == 130250
    assert one["power_w"] == 120.6 and one["power_limit_w"] == 700.0
    assert one["utilization_gpu_pct"] == 0


def test_process_pinned_to_cuda_device_1_shows_up_on_nvml_index_1_only():
    capture = _device_capture()
    holder = ast.literal_eval((FIXTURES / "h200x2_pinned_holder.txt").read_text())
    sections = {int(k): gpu.to_section(v["raw"]) for k, v in capture.items()}
    assert [p["pid"] for p in sections[1]["processes"]] == [holder["pid"]]
    assert sections[0]["processes"] == [] and sections[0]["memory_used_mib"] == 0
    assert sections[1]["uuid"] == f"GPU-{holder['uuid']}"
    assert sections[1]["pci_bus_id"] == "00000000:00:07.0"
    # The holder allocated 12 GiB; NVML adds its CUDA context.
    assert 12 * 1024 < sections[1]["processes"][0]["used_memory_mib"] < 13 * 1024


def test_shared_capture_matches_nvidia_smi_query():
    capture = json.loads((FIXTURES / "shared_h200x2_capture.json").read_text())
    smi = [
        line.split(", ")
        for line in (FIXTURES / "shared_h200x2_smi_loaded.csv").read_text().splitlines()
    ]
    for raw, row in zip(capture["loaded"]["gpus"], smi, strict=True):
        section = gpu.to_section(raw)
        assert section["memory_used_mib"] == int(row[1].split()[0])
        assert section["memory_total_mib"] == int(row[2].split()[0])
        assert section["memory_free_mib"] == int(row[3].split()[0])
        # The capture's utilisation struct came back empty: the field is None, not 0.
        assert section["utilization_gpu_pct"] is None


def test_v1_only_memory_reports_used_including_the_reserved_memory():
    raw = dict(_device_capture()["1"]["raw"], memory_v2=None)
    section = gpu.to_section(raw)
    assert section["memory_used_mib"] == 13522  # v1 used = v2 used + reserved
    assert section["memory_reserved_mib"] is None


def test_without_a_usable_gpu_the_section_is_absent_with_a_reason():
    section, reason = gpu.read_section(99)
    assert section is None
    assert reason and ("NVML" in reason or "not present" in reason)


def test_gpu_module_runs_as_a_plain_script_and_reports_errors_as_json():
    res = subprocess.run(
        [sys.executable, str(ROOT / "workers/tune/gpu.py"), "99"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "error" in json.loads(res.stdout)["99"]
