"""The GPU check's summary: its ratios, its goals (met or not), its table (bench/gpu_check.py)."""

from __future__ import annotations

from typing import Any

# Goals of issues 29 and 37: the fleet's busy slots until its last batch is taken; the fleet's
# whole job against SGLang's own offline engine on the same rows (tokens/s, and occupancy from
# both engines' own logs).
OCCUPANCY_GOAL = 0.99
OFFLINE_GOAL = 0.99


def ratio(num: float | None, den: float | None) -> float | None:
    """num ÷ den to 3 places; None when either is missing."""
    if not num or not den:
        return None
    return round(num / den, 3)


def order_ratios(job: dict[str, Any], before: list[dict[str, Any]],
                 after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fleet ÷ plain for each in-flight count measured before and after the fleet's job,
    and their mean (the order-controlled figure)."""
    out = []
    for b in before:
        a = next((p for p in after if p["in_flight"] == b["in_flight"]), None)
        rb = ratio(job.get("decode_tok_s"), b.get("decode_tok_s"))
        ra = ratio(job.get("decode_tok_s"), a.get("decode_tok_s")) if a else None
        both = [r for r in (rb, ra) if r is not None]
        out.append({"in_flight": b["in_flight"], "before": rb, "after": ra,
                     "mean": round(sum(both) / len(both), 3) if both else None})
    return out


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    """Issue 29's two goals, measured and met or not."""
    out: dict[str, Any] = {}
    for key in ("job", "fixed_job"):
        job = summary.get(key)
        if job:
            occ = job.get("occupancy_until_all_taken")
            out[f"{key}_occupancy_until_all_taken"] = {
                "value": occ, "goal": OCCUPANCY_GOAL,
                "met": occ is not None and occ >= OCCUPANCY_GOAL}
    anchor = summary.get("sglang_offline") or {}
    if anchor.get("fleet_ratio") is not None:
        out["fleet_vs_sglang_offline"] = {"value": anchor["fleet_ratio"], "goal": OFFLINE_GOAL,
                                          "met": anchor["fleet_ratio"] >= OFFLINE_GOAL}
    mine = (summary.get("job") or {}).get("occupancy_from_log")
    theirs = (anchor.get("occupancy_from_log") or {}).get("occupancy")
    if mine is not None and theirs is not None:  # the whole job, both from the engines' logs
        out["job_occupancy_vs_sglang_offline"] = {"value": mine, "goal": theirs,
                                                  "met": mine >= theirs}
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a plain two-column table."""
    rows = [("profile", summary["profile"]), ("engine", summary["engine"]),
            ("GPUs", summary["gpus"])]
    for w in summary["workers"]:
        rows.append((f"gpu{w['gpu']} start / cap / KV tokens",
                     f"{w['healthy_after_s']} s / {w['cap']} / {w['max_total_num_tokens']:,}"))
    rows += _table_rows(summary)
    rows.append(("GPU memory used after stop (MiB)", summary.get("memory_after_stop_mib")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _job_rows(key: str, j: dict[str, Any]) -> list[tuple[str, Any]]:
    """The table's lines for one fleet job (and the plain client run on its rows after it)."""
    v = j["verify"]
    rows: list[tuple[str, Any]] = [
        (f"{key}: prompts / s / decode tok/s / stored tok/s / occupancy (until all taken)",
         f"{j['prompts']} / {j['seconds']} / {j['decode_tok_s']} / {j['stored_tok_s']} / "
         f"{j['occupancy']} ({j['occupancy_until_all_taken']})"),
        (f"{key}: batches x size / occupancy from the engines' logs",
         f"{j['batches']} x {j.get('batch_size')} / {j.get('occupancy_from_log')}"),
        (f"{key}: verify", f"ok={v['ok']} unique={v['unique']} missing={v['missing']} "
         f"duplicates={v['duplicates']}")]
    for p in j.get("plain", []):
        rows.append((f"{key}: plain {p['in_flight']} in flight after: s / tok/s / occupancy / "
                     "fleet ratio", f"{p['seconds']} / {p['decode_tok_s']} / "
                     f"{p.get('occupancy')} / {p.get('fleet_ratio')}"))
    return rows


def _table_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The table's lines for the rows, the jobs, the plain runs, the anchor and the goals."""
    rows: list[tuple[str, Any]] = []
    r = summary.get("rows")
    if r:
        rows.append(("rows: prompts / sigma / mean, min, max tokens / sampling",
                     f"{r['prompts']} / {r['sigma']} / {r['mean_tokens']}, {r['min_tokens']}, "
                     f"{r['max_tokens']} / {r['sampling']}"))
    for p in summary.get("plain_before", []):
        rows.append((f"plain {p['in_flight']} in flight, before: s / tok/s / occupancy / "
                     "fleet ratio", f"{p['seconds']} / {p['decode_tok_s']} / "
                     f"{p.get('occupancy')} / {p.get('fleet_ratio')}"))
    for key in ("job", "fixed_job", "fault_job"):
        if summary.get(key):
            rows += _job_rows(key, summary[key])
    for p in summary.get("plain", []):
        rows.append((f"plain {p['in_flight']} in flight: s / tok/s / occupancy / fleet ratio",
                     f"{p['seconds']} / {p['decode_tok_s']} / {p.get('occupancy')} / "
                     f"{p.get('fleet_ratio')}"))
    for o in summary.get("fleet_vs_plain", []):
        rows.append((f"fleet / plain {o['in_flight']}: before / after / mean",
                     f"{o['before']} / {o['after']} / {o['mean']}"))
    rows += _anchor_rows(summary.get("sglang_offline"))
    if sv := summary.get("samples_vs_copies"):
        rows.append((f"{sv['prompts']} prompts x {sv['samples']} samples vs copies: tok/s ratio "
                     "/ prefill ratio samples / copies",
                     f"{sv['tok_s_ratio']:.3f} / {sv['prefill_ratio_samples']:.3f} / "
                     f"{sv['prefill_ratio_copies']:.3f} (verified {sv['verified'] == 1.0})"))
    for name, g in summary.get("goals", {}).items():
        rows.append((f"goal {name}", f"{g['value']} (>= {g['goal']}: "
                     f"{'met' if g['met'] else 'not met'})"))
    return rows


def _anchor_rows(a: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The table's lines for SGLang's offline anchor."""
    if not a:
        return []
    rows: list[tuple[str, Any]] = [
        ("sglang_offline: output tok/s / s / fleet ratio",
         f"{a.get('output_tok_s')} / {a.get('seconds')} / {a.get('fleet_ratio')}"
         if "error" not in a else f"error: {a['error'][:200]}")]
    if a.get("occupancy_from_log"):
        rows.append(("sglang_offline: occupancy from its log",
                     a["occupancy_from_log"].get("occupancy")))
    return rows
