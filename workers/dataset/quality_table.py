"""The quality of the rows, measured over an Arrow table column by column: the sink's path.

The sink measures every row group it writes with :func:`add_table` (pyarrow.compute over the
columns, the long strings never copied); rows that need the per-row path
(:meth:`workers.dataset.quality.QualityTally.add`: not ok, ``<think>`` markers, tool calls,
structured output, a job of samples) take it. tests/test_quality.py holds both paths to the
same figures; bench/quality.py measures what this costs the sink.
"""

from __future__ import annotations

from typing import Any

from workers.dataset.quality import (
    BUCKETS_PER_DOUBLING,
    EXACT,
    EXAMPLES,
    KEY_CHARS,
    Figure,
    QualityTally,
)

# Columns add_table reads (the sink's row-group tables and verify's per-batch ones hold them).
COLUMNS = ("index", "sample", "id", "status", "error", "prompt", "messages", "finish_reason",
           "completion", "reasoning", "tool_calls", "completion_tokens", "profile")


def add_table(tally: QualityTally, table: Any) -> None:
    """Measure the rows of an Arrow table (SCHEMA's columns) as :meth:`QualityTally.add`
    would one by one, vectorized: the sink measures each row group it writes this way.
    Rows that need the per-row path (not ok, ``<think>`` markers, tool calls, structured
    output, a job of samples) take it. Columns are masked, never filtered whole: the long
    strings are not copied."""
    import pyarrow.compute as pc

    table = table.select(list(COLUMNS))
    if tally.options.sampled or tally.options.any_constraint():
        for row in table.to_pylist():
            tally.add(row)
        return
    ok = pc.fill_null(pc.equal(table["status"], "ok"), False)
    slow = pc.or_(pc.or_(pc.invert(ok), _marked(table["completion"])),
                  pc.is_valid(table["tool_calls"]))
    if pc.any(slow).as_py():
        for row in table.filter(slow).to_pylist():
            tally.add(row)
    fast = pc.invert(slow)
    if pc.any(fast).as_py():
        _add_answered(tally, table, fast, pc)


def _marked(values: Any) -> Any:
    """Which strings hold ``think>``: a memchr pass for ``<`` over the array's data (Arrow's
    match_substring costs ~50 µs per 10k characters), then a look at each hit."""
    import numpy as np
    import pyarrow as pa

    out = []
    for chunk in values.chunks:
        n = len(chunk)
        flags = np.zeros(n, dtype=bool)
        if n:
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[
                chunk.offset:chunk.offset + n + 1]
            data = chunk.buffers()[2]
            lo, hi = int(offsets[0]), int(offsets[-1])
            raw = data.to_pybytes() if data is not None else b""  # one copy; find takes bounds
            pos = raw.find(b"<", lo, hi)
            while pos >= 0:
                if raw.startswith((b"<think>", b"</think>"), pos, hi):
                    flags[np.searchsorted(offsets, pos, side="right") - 1] = True
                pos = raw.find(b"<", pos + 1, hi)
        out.append(pa.array(flags))
    return pa.chunked_array(out, type=pa.bool_())


def _examples(fig: Figure, table: Any, mask: Any, pc: Any) -> None:
    n = pc.sum(mask).as_py() or 0
    if n:
        ids = table["id"].filter(mask).slice(0, EXAMPLES).to_pylist()
        for rid in ids[: max(EXAMPLES - len(fig.examples), 0)]:
            fig.examples.append(str(rid))
        fig.count += n


def _add_answered(tally: QualityTally, t: Any, fast: Any, pc: Any) -> None:
    """Answered rows without markers (``fast``, the common case), column by column."""
    import pyarrow as pa

    n = pc.sum(fast).as_py() or 0
    tally.rows += n
    tally.answered += n
    tokens = pc.cast(pc.fill_null(t["completion_tokens"], 0), pa.int64())
    ftok = pc.cast(tokens, pa.float64())
    big = pc.greater_equal(tokens, EXACT)
    logb = pc.add(pc.floor(pc.multiply(pc.log2(pc.divide(pc.max_element_wise(ftok, 1.0),
                                                           float(EXACT))),
                                       float(BUCKETS_PER_DOUBLING))), float(EXACT))
    buckets = pc.if_else(big, pc.cast(logb, pa.int64()), tokens).filter(fast)
    tally.max_tokens = max(tally.max_tokens, pc.max(tokens.filter(fast)).as_py() or 0)
    counts = pc.value_counts(buckets)
    hist = tally._hist
    for b, c in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(),
                    strict=True):
        hist[b] = hist.get(b, 0) + c
    cut = pc.fill_null(pc.equal(t["finish_reason"], "length"), False)
    _examples(tally.figures["truncated"], t, pc.and_(fast, cut), pc)
    fast = pc.and_(fast, pc.invert(cut))  # a truncated row is counted under truncated alone
    tally.texts += pc.sum(fast).as_py() or 0
    comp, reas = t["completion"], t["reasoning"]
    clen = pc.fill_null(pc.binary_length(comp), 0)
    rlen = pc.fill_null(pc.binary_length(reas), 0)
    blank = pc.or_(pc.equal(clen, 0), pc.fill_null(pc.utf8_is_space(comp), False))
    text = pc.cast(pc.add(clen, rlen), pa.float64())
    share = pc.divide(pc.cast(clen, pa.float64()), pc.max_element_wise(text, 1.0))
    est = pc.if_else(pc.greater(rlen, 0), pc.round(pc.multiply(ftok, share)), ftok)
    near = pc.or_(blank, pc.less(est, float(tally.options.near_empty_tokens)))
    _examples(tally.figures["near_empty"], t, pc.and_(fast, near), pc)
    thinking = _thinking_mask(tally, t, pc)
    if thinking is not None:
        thinking = pc.and_(fast, thinking)
        tally.thinking += pc.sum(thinking).as_py() or 0
        no_r = pc.and_(thinking, pc.or_(pc.equal(rlen, 0),
                                        pc.fill_null(pc.utf8_is_space(reas), False)))
        _examples(tally.figures["no_reasoning"], t, no_r, pc)
    keep = pc.and_(fast, pc.invert(blank))
    if pc.any(keep).as_py():
        kc = pc.cast(comp, pa.binary())
        # b"<bytes>|<first KEY_CHARS bytes>|<last KEY_CHARS bytes>", as quality.answer_key
        key = pc.binary_join_element_wise(
            pc.cast(pc.cast(clen, pa.string()), pa.binary()), pc.binary_slice(kc, 0, KEY_CHARS),
            pc.binary_slice(kc, -KEY_CHARS), pa.scalar(b"|", pa.binary()))
        keys = list(map(hash, key.filter(keep).to_pylist()))
        tally.identical_bulk(keys, t["index"].filter(keep).to_pylist(),
                             t["id"].filter(keep).to_pylist())


def _thinking_mask(tally: QualityTally, t: Any, pc: Any) -> Any:
    """Which rows are of thinking mode (None: none can be)."""
    probe = tally.options.thinking
    profiles = [p for p in pc.unique(t["profile"]).to_pylist() if p]
    chat_rows = [p for p in profiles if probe({"profile": p, "messages": []})]
    if not chat_rows:
        return None
    plain = [p for p in chat_rows if probe({"profile": p, "messages": None})]
    import pyarrow as pa

    mask = pc.fill_null(pc.is_in(t["profile"], value_set=pa.array(chat_rows)), False)
    if set(plain) != set(chat_rows):
        mask = pc.and_(mask, pc.is_valid(t["messages"]))
    if off := tally.options.row_no_thinking:  # rows whose own request turned thinking off
        mask = pc.and_(mask, pc.invert(pc.is_in(t["index"], value_set=pa.array(
            sorted(off), t["index"].type))))
    return mask
