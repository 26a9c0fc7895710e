"""Human-readable text for ``diagnose`` (``--json`` prints the object itself)."""

from __future__ import annotations

from typing import Any


def _flag_lines(flags: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in flags.items():
        if value is None:
            lines.append(f"  remove --{key}")
        elif value is True:
            lines.append(f"  --{key}")
        else:
            lines.append(f"  --{key} {value}")
    return lines


def _predicted_lines(predicted: dict[str, Any] | None,
                     chosen: dict[str, Any] | None) -> list[str]:
    if not predicted:
        return []
    memory = ", ".join(f"{k} {v:.2f}" for k, v in predicted["memory_gb"].items())
    holds = ""
    if chosen and chosen.get("kv_holds_requests") is not None:
        holds = f" (they hold {chosen['kv_holds_requests']} requests of kv_need_per_request)"
    return [
        f"predicted: {predicted['max_running_requests']} running, "
        f"{predicted['mamba_slots']} Mamba slots (R={predicted['mamba_ratio']}), "
        f"{predicted['kv_tokens']:,} KV tokens{holds}",
        f"memory (GiB): {memory}",
    ]


def diagnosis_text(d: dict[str, Any]) -> str:
    """Render a ``diagnose --json`` object as text."""
    lines = [f"binding constraint: {d['binding_constraint']} ({d['cause']})"]
    lines += [f"note: {n}" for n in d.get("notes", [])]
    lines.append("evidence:")
    for e in d["evidence"]:
        lines.append(f"  {e['name']:<26} {e['value']!s:<12} {e['source']}")
    unread = d.get("unread_evidence") or []
    if unread:
        lines.append("could not read (estimated instead):")
        lines += [f"  - {u}" for u in unread]
    missing = d.get("missing_evidence") or []
    if missing:
        lines.append("further evidence that would sharpen this:")
        lines += [f"  - {m}" for m in missing]
    rec = d["recommendation"]
    lines.append(f"recommendation ({rec.get('chosen') or 'no flag change'}):")
    lines += _flag_lines(rec["flags"])
    if rec.get("client_concurrency") is not None:
        lines.append(f"  client concurrency: {rec['client_concurrency']}")
    chosen = next((o for o in rec.get("options") or [] if o["name"] == rec.get("chosen")), None)
    lines += _predicted_lines(rec.get("predicted"), chosen)
    lines.append("why:")
    lines += [f"  - {r}" for r in rec.get("reasons", [])]
    return "\n".join(lines)
