"""Staging in-process: the readers' row dicts, the staged batches and the background writer."""

from __future__ import annotations

import gzip
import hashlib
import threading
import time
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.enqueue import PARALLEL_PUTS, BatchWriter, EnqueueReport, stage
from producer.readers import PROBE_ROWS, read_rows
from workers.dataset.jobs import PromptRow, input_key, load_batch_input
from workers.dataset.store import LocalStore
from workers.errors import InputError, StoreError

# Every shape a reader meets: prompts, chats, OpenAI-batch bodies with parameters, ids that are
# numbers or missing, and each reason a row is quarantined.
ROWS = [
    {"id": "p0", "prompt": "Why?"},
    {"messages": [{"role": "user", "content": "Hi"}]},
    {"custom_id": "c2", "method": "POST", "body": {"model": "m", "stream": False,
     "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}},
    {"custom_id": 3, "body": {"prompt": "p", "temperature": 0.5}},
    [1, 2],
    {"text": "no prompt"},
    {"prompt": " \t"},
    {"messages": []},
    {"messages": [{"role": "user"}]},
    {"prompt": 7},
    {"id": None, "prompt": "\u00fc \U0001F600", "extra": {"a": 1}},
]
# Fingerprint and sha256 of the uncompressed staged batches of ROWS (batches of 4) as staged
# through PromptRow.model_dump before staging built the dicts directly: jobs created then must
# still match (re-enqueue compares fingerprints) and workers read the same bytes.
FINGERPRINT = "493a95a9ed93ca26a46916ed740ef83da0e9bc65fcecf11713d05b110744dc5e"
STAGED_SHA256 = "3eaf4b9e458883e25457abcdcd6b8e9e79e2cf3998be16d1141f3f8f289bd240"


def _write_rows(path: Path) -> Path:
    """ROWS as JSONL, with blank lines after the fifth row (they take line numbers 6 and 7)."""
    lines = [orjson.dumps(r) for r in ROWS]
    path.write_bytes(b"\n".join([*lines[:5], b"", b"  ", *lines[5:]]) + b"\n")
    return path


def _stage(store: LocalStore, rows, batch_size: int = 4) -> tuple[int, int, str, EnqueueReport]:
    report = EnqueueReport(spec=None, created=True)  # type: ignore[arg-type]
    total, n, fingerprint = stage(store, "j", rows, batch_size, report, skip_existing=False)
    return total, n, fingerprint, report


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stage-writer"]


def test_reader_dicts_are_what_prompt_row_stages(tmp_path):
    rows = list(read_rows(_write_rows(tmp_path / "in.jsonl")))
    assert [r["index"] for r in rows] == list(range(len(ROWS)))
    for row in rows:
        assert PromptRow.model_validate(row).model_dump(exclude_defaults=True) == row
    assert rows[2]["params"] == {"max_tokens": 5} and rows[3]["id"] == "3"
    assert rows[4]["error"] == "line 5: row is not an object"
    assert rows[5]["error"] == "line 8: no 'prompt' or 'messages'"


def test_staged_batches_and_fingerprint_are_unchanged(tmp_path):
    store = LocalStore(tmp_path / "store")
    total, n, fingerprint, report = _stage(store, read_rows(_write_rows(tmp_path / "in.jsonl")))
    assert (total, n, report.staged, fingerprint) == (11, 3, 3, FINGERPRINT)
    raw = [store.get(input_key("j", b)) for b in range(n)]
    assert all(x[:2] == b"\x1f\x8b" for x in raw)  # gzip, as workers/dataset/jobs.py decodes it
    assert hashlib.sha256(b"".join(map(gzip.decompress, raw))).hexdigest() == STAGED_SHA256
    assert len(report.bad_rows) == 6 and report.bad_rows[0] == "line 5: row is not an object"
    batch = load_batch_input(store, "j", 2)
    assert [r.index for r in batch] == [8, 9, 10] and batch[2].prompt == "\u00fc \U0001F600"


def test_parquet_rows_stage_like_jsonl_rows(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "prompt": ["hello", None, ""],
                             "messages": [None, [{"role": "user", "content": "x"}], None]}), path)
    store = LocalStore(tmp_path / "store")
    total, n, _, report = _stage(store, read_rows(path), batch_size=2)
    assert (total, n) == (3, 2)
    assert [r.model_dump(exclude_defaults=True) for r in load_batch_input(store, "j", 0)] == [
        {"index": 0, "id": "a", "prompt": "hello"},
        {"index": 1, "id": "1", "messages": [{"role": "user", "content": "x"}]}]
    assert report.bad_rows == ["row 2: 'prompt' must be a non-empty string"]


class FailingStore(LocalStore):
    """A local store whose put of batch ``fail_batch`` fails like a full disk; it records the
    order in which puts start and fail."""

    def __init__(self, root: Path, fail_batch: int) -> None:
        super().__init__(root)
        self.fail_key, self.events = input_key("j", fail_batch), []
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self.events.append(("start", key))
        if key == self.fail_key:
            with self._lock:
                self.events.append(("failed", key))
            raise StoreError(f"cannot write {key}: [Errno 28] No space left on device")
        super().put(key, data)


def test_a_failed_write_stops_staging_with_its_store_error(tmp_path):
    store = FailingStore(tmp_path / "store", fail_batch=2)
    rows = ({"index": i, "id": str(i), "prompt": f"q{i}"} for i in range(1000))
    with pytest.raises(StoreError, match="b000002.jsonl.gz: .* No space left"):
        _stage(store, rows, batch_size=10)
    # Puts already running when it failed may finish; the parser stops and at most a pool's
    # worth of batches (plus the queue) was ever handed out, far from the job's 100.
    started = [key for ev, key in store.events if ev == "start"]
    assert len(started) <= 3 + PARALLEL_PUTS + 2 < 100
    stored = set(store.list("jobs/j/inputs/"))
    assert {input_key("j", 0), input_key("j", 1)} <= stored and store.fail_key not in stored
    assert not _writer_threads()


def test_a_failed_last_write_is_raised_when_staging_ends(tmp_path):
    store = FailingStore(tmp_path / "store", fail_batch=1)
    rows = [{"index": i, "id": str(i), "prompt": f"q{i}"} for i in range(20)]
    with pytest.raises(StoreError):
        _stage(store, rows, batch_size=10)
    assert not _writer_threads()


def _with_bad_line(path: Path, good: int) -> Path:
    """``good`` valid rows, then a line that is not JSON (line ``good + 1``)."""
    path.write_bytes(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(good))
                     + b'{"prompt": broken\n')
    return path


def test_bad_json_mid_file_stops_staging_after_the_queued_writes(tmp_path):
    # Past the reader's probe (its first PROBE_ROWS rows are read before any is staged), the
    # batches already queued are written, nothing after the bad line, and no thread is left.
    good = PROBE_ROWS + 25
    src = _with_bad_line(tmp_path / "in.jsonl", good)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(InputError, match=rf"in\.jsonl:{good + 1}: not valid JSON"):
        _stage(store, read_rows(src), batch_size=10)
    assert sorted(store.list("jobs/j/inputs/")) == [input_key("j", b) for b in range(good // 10)]
    assert not _writer_threads()


def test_bad_json_within_the_probe_stages_nothing(tmp_path):
    src = _with_bad_line(tmp_path / "in.jsonl", 25)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(InputError, match=r"in\.jsonl:26: not valid JSON"):
        _stage(store, read_rows(src), batch_size=10)
    assert not list(store.list("jobs/j/inputs/"))
    assert not _writer_threads()


def test_batch_writer_writes_in_order_and_compresses(tmp_path):
    store = LocalStore(tmp_path / "store")
    with BatchWriter(store, depth=1) as writer:
        for b in range(5):
            writer.put(input_key("j", b), b'{"index":%d}\n' % b)
    assert [gzip.decompress(store.get(input_key("j", b))) for b in range(5)] == [
        b'{"index":%d}\n' % b for b in range(5)]


class BarrierStore(LocalStore):
    """The first ``parties`` puts each wait until all of them are running at once (a
    BrokenBarrierError, so a failed staging, if the writer never has that many in flight).
    A key in ``fail`` fails; with ``after_writer_failed`` it fails only once the writer has
    recorded another failure."""

    def __init__(self, root: Path, parties: int, fail: tuple[str, ...] = (),
                 after_writer_failed: str | None = None) -> None:
        super().__init__(root)
        self.barrier = threading.Barrier(parties, timeout=10)
        self.parties, self.started = parties, 0
        self.fail, self.after_writer_failed = fail, after_writer_failed
        self.writer: BatchWriter | None = None
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            first_round, self.started = self.started < self.parties, self.started + 1
        if first_round:
            self.barrier.wait()
        if key == self.after_writer_failed:
            deadline = time.monotonic() + 10
            while self.writer is None or self.writer.error is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        if key in self.fail:
            raise StoreError(f"cannot write {key}: timed out")
        super().put(key, data)


def test_batch_writer_has_its_pool_of_puts_in_flight_at_once(tmp_path):
    store = BarrierStore(tmp_path / "store", parties=PARALLEL_PUTS)
    n = 3 * PARALLEL_PUTS
    with BatchWriter(store) as writer:
        for b in range(n):
            writer.put(input_key("j", b), b'{"index":%d}\n' % b)
    assert [gzip.decompress(store.get(input_key("j", b))) for b in range(n)] == [
        b'{"index":%d}\n' % b for b in range(n)]


def test_parallel_writer_reports_the_first_failure_in_time(tmp_path):
    # Batch 1 fails only after batch 5's failure was recorded: batch 5's error is raised.
    b1, b5 = input_key("j", 1), input_key("j", 5)
    store = BarrierStore(tmp_path / "store", parties=PARALLEL_PUTS, fail=(b1, b5),
                         after_writer_failed=b1)
    with pytest.raises(StoreError, match="b000005"):
        with BatchWriter(store) as writer:
            store.writer = writer
            for b in range(4 * PARALLEL_PUTS):
                writer.put(input_key("j", b), b'{"index":%d}\n' % b)
    assert not store.exists(b1) and not store.exists(b5)
    # Nothing is started once a failure is recorded: far from all 32 batches were tried.
    assert store.started < 4 * PARALLEL_PUTS
    assert not _writer_threads()
