"""Facts read from an SGLang engine log: the startup memory lines and the periodic batch lines.

The patterns follow the f-strings of every release from 0.5.10.post1 to 0.5.23
(:mod:`workers.engine.releases` says which release prints which): ``model_runner.py`` (``Load
weight begin/end``), ``mem_cache/memory_pool.py`` (``Mamba Cache is allocated``, ``KV Cache is
allocated``, with ``dtype: …,`` from 0.5.13 and a ``Full``/``SWA`` label on hybrid SWA pools
from 0.5.17), the CUDA graph lines (``Capture cuda graph end. Time elapsed: …`` through 0.5.13,
``Capture target decode CUDA graph end. [bs=[…], ]elapsed=…`` from 0.5.14,
``model_runner_components/cuda_graph_setup.py``), ``managers/scheduler.py``
(``max_total_num_tokens=…``) and the batch lines of ``scheduler_metrics_mixin.py`` (0.5.13 on:
``scheduler_components/metrics_reporter.py``), all in ``[%(asctime)s{ DPr}{ PPr}{ TPr}]
message`` (``srt/utils/common.py::configure_logger``). "GB" in these lines means GiB. Lines
without the bracketed prefix (another logger format) are read as bare messages.

Every TP rank prints the startup lines (``Load weight end`` included), so only rank 0's are
read: a second ``Load weight end`` from rank 0 is the speculative draft model, one from TP1 is
not. A startup line whose marker is there but whose format is none of these releases' is
listed in :attr:`LogFacts.unread`, so the tuner says what it could not read instead of falling
back silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PREFIX = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)(?P<ranks>[^\]]*)\] ")
_NUM = r"([0-9]+(?:\.[0-9]+)?)"

_WEIGHT_BEGIN = re.compile(rf"Load weight begin\. avail mem={_NUM} GB")
_WEIGHT_END = re.compile(rf"Load weight end\..*avail mem={_NUM} GB, mem usage={_NUM} GB")
# 0.5.18 on, with the startup weight overlap: a second, timing-only line (startup_weight_load.py).
_WEIGHT_COMMIT = re.compile(r"Load weight end\. Committed real weights after CUDA graph capture")
_MAMBA = re.compile(
    rf"Mamba Cache is allocated\. max_mamba_cache_size: (\d+), "
    rf"conv_state size: {_NUM}\s*GB, ssm_state size: {_NUM}\s*GB"
)
_MAMBA_SPEC = re.compile(
    rf"intermediate_ssm_state_cache size: {_NUM}\s*GB "
    rf"intermediate_conv_window_cache size: {_NUM}\s*GB"
)
_KV_HEAD = r"(?P<label>(?:Full|SWA) )?KV Cache is allocated\. (?:dtype: (?P<dtype>[\w.]+), )?"
_KV_MHA = re.compile(rf"{_KV_HEAD}#tokens: (?P<tokens>\d+), K size: {_NUM} GB, V size: {_NUM} GB")
_KV_MLA = re.compile(rf"{_KV_HEAD}#tokens: (?P<tokens>\d+), KV size: {_NUM} GB")
# Opt-in from 0.5.16 (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING): the pool resized after the graphs.
_KV_POST_CAPTURE = re.compile(r"Post-capture KV sizing: KV cache allocated\. dtype: [\w.]+, "
                              r"#tokens: (\d+),")
_POOL_END = re.compile(rf"Memory pool end\. avail mem={_NUM} GB")
_GRAPH_END_LEGACY = re.compile(
    rf"Capture cuda graph end\..*mem usage={_NUM} GB\. avail mem={_NUM} GB"
)
_GRAPH_END_NAMED = re.compile(
    rf"Capture (?P<name>[\w ]+?) (?:CUDA|cuda) graph end\. (?:bs=\[[^\]]*\], )?"
    rf"elapsed=[0-9.]+ s, mem usage={_NUM} GB, avail mem={_NUM} GB"
)
_SCHEDULER = re.compile(
    r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
    rf"max_running_requests=(\d+), context_len=(\d+), available_gpu_mem={_NUM} GB"
)
_SPEC_RESET = re.compile(r"Max running requests is reset to (\d+) for speculative decoding")
_OVERLAP_OFF = "Disabling overlap schedule since mamba no_buffer"
_BATCH = re.compile(r"^(Decode|Prefill) batch(?: \[\d+\])?, (.*)$")
_SERVER_ARGS = re.compile(r"server_args=ServerArgs\((.*)\)\s*$")
_RANK = re.compile(r" (TP|PP|EP)(\d+)")
# Marker of each startup line the tuner needs, and the patterns that read it.
_MUST_READ: tuple[tuple[str, tuple[re.Pattern[str], ...]], ...] = (
    ("Load weight end", (_WEIGHT_END, _WEIGHT_COMMIT)),
    ("Mamba Cache is allocated", (_MAMBA,)),
    ("KV Cache is allocated", (_KV_MHA, _KV_MLA)),
    ("max_total_num_tokens=", (_SCHEDULER,)),
)
_ARG = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^,()\[\]]+)")


@dataclass(frozen=True)
class MambaAlloc:
    """The ``Mamba Cache is allocated`` line (sizes in GiB)."""

    slots: int
    conv_gib: float
    ssm_gib: float
    intermediate_ssm_gib: float | None = None
    intermediate_conv_gib: float | None = None


@dataclass(frozen=True)
class SchedulerLine:
    """The scheduler's ``max_total_num_tokens=…, max_running_requests=…`` startup line."""

    max_total_num_tokens: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    max_running_requests: int
    context_len: int
    available_gpu_mem_gib: float


@dataclass(frozen=True)
class BatchLine:
    """One periodic ``Decode batch`` or ``Prefill batch`` line as key -> value."""

    kind: str  # "decode" | "prefill"
    timestamp: str | None
    fields: dict[str, float | bool | str]

    def number(self, *keys: str) -> float | None:
        """The first of ``keys`` present as a number."""
        for key in keys:
            value = self.fields.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None


@dataclass
class LogFacts:
    """Everything the tuner reads from one engine log."""

    weights_begin_avail_gib: float | None = None
    weights_end_avail_gib: float | None = None
    weights_gib: float | None = None
    draft_weights_gib: float | None = None
    mamba: MambaAlloc | None = None
    kv_tokens: int | None = None
    kv_gib: float | None = None
    kv_seen: bool = False  # the target's KV line went by (read or not)
    kv_dtype: str | None = None  # "torch.bfloat16" (the line says it from 0.5.13)
    post_capture_kv_tokens: int | None = None  # the pool after the post-capture resize
    pool_end_avail_gib: float | None = None
    graph_gib: float | None = None
    graph_end_avail_gib: float | None = None
    scheduler: SchedulerLine | None = None
    spec_reset_to: int | None = None
    overlap_disabled_by_no_buffer: bool = False
    # The resolved ServerArgs SGLang prints at launch (scalar fields only).
    server_args: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    batches: list[BatchLine] = field(default_factory=list)
    # Startup lines whose format this parser does not know (the line, shortened).
    unread: list[str] = field(default_factory=list)

    def decode_lines(self) -> list[BatchLine]:
        """The decode lines, oldest first."""
        return [b for b in self.batches if b.kind == "decode"]


def _value(text: str) -> float | bool | str:
    text = text.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text)
    except ValueError:
        return text


def _arg_value(text: str) -> str | int | float | bool | None:
    text = text.strip()
    if text[:1] in ("'", '"'):
        return text[1:-1]
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_server_args(message: str) -> dict[str, str | int | float | bool | None]:
    """Scalar fields of a ``server_args=ServerArgs(...)`` line ({} if it is not one)."""
    match = _SERVER_ARGS.search(message)
    if not match:
        return {}
    return {key: _arg_value(value) for key, value in _ARG.findall(match.group(1))}


def parse_batch(message: str, timestamp: str | None = None) -> BatchLine | None:
    """Parse a ``Decode batch, …`` / ``Prefill batch, …`` message, or None."""
    match = _BATCH.match(message)
    if not match:
        return None
    fields: dict[str, float | bool | str] = {}
    for part in match.group(2).split(", "):
        key, sep, value = part.partition(": ")
        if sep:
            fields[key.strip()] = _value(value.rstrip(","))
    return BatchLine(match.group(1).lower(), timestamp, fields)


def _split(line: str) -> tuple[str | None, str, bool]:
    """(timestamp, message, whether the line comes from rank 0 of TP, PP and EP)."""
    match = _PREFIX.match(line)
    if not match:
        return None, line.strip(), True
    rank0 = all(n == "0" for _, n in _RANK.findall(match.group("ranks")))
    return match.group("ts"), line[match.end() :].strip(), rank0


def _check_format(message: str, facts: LogFacts) -> None:
    """Note a startup line whose marker is present but whose format is unknown."""
    for marker, patterns in _MUST_READ:
        if marker in message and not any(p.search(message) for p in patterns):
            facts.unread.append(message[:160])


def _read_mamba(message: str) -> MambaAlloc | None:
    match = _MAMBA.search(message)
    if not match:
        return None
    spec = _MAMBA_SPEC.search(message)
    return MambaAlloc(
        slots=int(match.group(1)),
        conv_gib=float(match.group(2)),
        ssm_gib=float(match.group(3)),
        intermediate_ssm_gib=float(spec.group(1)) if spec else None,
        intermediate_conv_gib=float(spec.group(2)) if spec else None,
    )


def _read_kv(message: str, facts: LogFacts) -> None:
    if match := _KV_POST_CAPTURE.search(message):
        facts.post_capture_kv_tokens = int(match.group(1))
        return
    if "KV Cache is allocated" not in message:
        return
    if facts.kv_seen:
        return  # the draft model's own (small) KV pool comes second: never the target's
    facts.kv_seen = True
    if match := _KV_MHA.search(message):
        facts.kv_tokens = int(match.group("tokens"))
        facts.kv_gib = float(match.group(4)) + float(match.group(5))
    elif match := _KV_MLA.search(message):
        facts.kv_tokens = int(match.group("tokens"))
        facts.kv_gib = float(match.group(4))
    if match:
        facts.kv_dtype = match.group("dtype")


def _read_weights(message: str, facts: LogFacts) -> None:
    if match := _WEIGHT_BEGIN.search(message):
        if facts.weights_begin_avail_gib is None:
            facts.weights_begin_avail_gib = float(match.group(1))
    elif match := _WEIGHT_END.search(message):
        if facts.weights_gib is None:
            facts.weights_end_avail_gib = float(match.group(1))
            facts.weights_gib = float(match.group(2))
        else:  # the speculative draft model loads after the target
            facts.draft_weights_gib = float(match.group(2))


def _read_graph_and_pool(message: str, facts: LogFacts) -> None:
    if match := _POOL_END.search(message):
        if facts.pool_end_avail_gib is None:
            facts.pool_end_avail_gib = float(match.group(1))
    elif match := _GRAPH_END_LEGACY.search(message):
        if facts.graph_gib is None:
            facts.graph_gib = float(match.group(1))
            facts.graph_end_avail_gib = float(match.group(2))
    elif match := _GRAPH_END_NAMED.search(message):
        # "target decode" / "target verify" are the target's decode graphs; the draft's and
        # the prefill graphs have their own lines.
        name = match.group("name")
        if facts.graph_gib is None and name in ("target decode", "target verify"):
            facts.graph_gib = float(match.group(2))
            facts.graph_end_avail_gib = float(match.group(3))


def _read_scheduler(message: str, facts: LogFacts) -> None:
    if match := _SCHEDULER.search(message):
        t, c, p, r, ctx, avail = match.groups()
        facts.scheduler = SchedulerLine(int(t), int(c), int(p), int(r), int(ctx), float(avail))
    elif match := _SPEC_RESET.search(message):
        facts.spec_reset_to = int(match.group(1))
    elif _OVERLAP_OFF in message:
        facts.overlap_disabled_by_no_buffer = True


def _read_line(line: str, facts: LogFacts) -> None:
    timestamp, message, rank0 = _split(line)
    batch = parse_batch(message, timestamp)
    if batch is not None:
        facts.batches.append(batch)
        return
    if not rank0:
        return  # every TP rank repeats the startup lines
    _check_format(message, facts)
    if not facts.server_args and "server_args=ServerArgs(" in message:
        facts.server_args = parse_server_args(message)
        return
    mamba = _read_mamba(message)
    if mamba is not None:
        facts.mamba = facts.mamba or mamba
        return
    _read_kv(message, facts)
    _read_weights(message, facts)
    _read_graph_and_pool(message, facts)
    _read_scheduler(message, facts)


def parse_log(text: str) -> LogFacts:
    """Read the startup arithmetic and batch lines from an engine log (the last start wins).

    Within one start the target model comes first and the speculative draft model second
    (both log weights, KV pool and CUDA graphs); the scheduler line closes the start.
    """
    facts = LogFacts()
    for line in text.splitlines():
        if "Load weight begin" in line and facts.scheduler is not None:
            facts = LogFacts()  # a restart: only the latest start describes the pools
        _read_line(line, facts)
    return facts
