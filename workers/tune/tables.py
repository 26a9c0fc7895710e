"""Readable tables for the tune commands (``--json`` prints the objects themselves)."""

from __future__ import annotations

from typing import Any

import orjson
from rich.table import Table

WIDE_S = 70  # nested values longer than this are cut in a table cell


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, str):
        return value
    text = orjson.dumps(value).decode()
    return text if len(text) <= WIDE_S else text[: WIDE_S - 1] + "…"


def object_table(title: str, data: dict[str, Any]) -> Table:
    """Key / value rows of an object; nested objects one level down as ``key.sub``."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in data.items():
        if isinstance(value, dict) and value and len(value) <= 12:
            for sub, inner in value.items():
                table.add_row(f"{key}.{sub}", _cell(inner))
        else:
            table.add_row(key, _cell(value))
    return table


PLAN_ROWS = (
    ("profile", lambda p: p["profile"]),
    ("running requests / GPU", lambda p: p["running_per_gpu"]),
    ("running cap", lambda p: p["predicted"].get("max_running_requests")),
    ("KV holds (this job)", lambda p: p.get("kv_holds_requests")),
    ("Mamba slots", lambda p: p["predicted"].get("mamba_slots")),
    ("KV tokens", lambda p: p["predicted"].get("kv_tokens")),
    ("tok/s per GPU", lambda p: p["tok_s_per_gpu"]),
    ("tok/s total", lambda p: p["tok_s_total"]),
    ("requests/s", lambda p: p["requests_per_s"]),
    ("ETA (hours)", lambda p: p["eta_hours"]),
    ("cost", lambda p: p.get("cost")),
)


def plan_table(given: dict[str, Any], tuned: dict[str, Any] | None) -> Table:
    """The given profile's plan beside the tuner's choice for the same GPU."""
    table = Table(title=f"plan on a {given['gpu_memory_mib']:,} MiB GPU", title_justify="left")
    table.add_column("")
    table.add_column("given profile", justify="right")
    table.add_column("tuner would launch", justify="right")
    for label, get in PLAN_ROWS:
        table.add_row(label, _cell(get(given)),
                      _cell(get(tuned)) if tuned else "no better setting found")
    if tuned:
        changes = tuned.get("flag_changes") or {}
        table.add_row("flag changes", "", ", ".join(f"--{k} {v}" for k, v in changes.items()))
    if given.get("unread_evidence"):
        table.caption = "not read: " + "; ".join(given["unread_evidence"])
        table.caption_justify = "left"
    return table
