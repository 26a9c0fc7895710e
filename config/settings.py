"""All fleet settings in one place, read from the environment (prefix ``FLEET_``).

Each section is its own ``BaseSettings`` with its own prefix so that the names users type stay
flat (``FLEET_SIM_SPEED``, ``FLEET_S3_ENDPOINT_URL``) while code reads ``settings.sim.speed``.
Nothing here is read at import time: call :func:`load_settings` once per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# What .env.example ships with: a deployment that still holds one of these is refused.
PLACEHOLDERS = frozenset({"change-me", "changeme", "change_me", "password", "secret"})


def _default_store_url() -> str:
    return (Path.cwd() / "fleet-data").as_uri()


def is_placeholder(value: str | None) -> bool:
    """Whether ``value`` is a placeholder secret (``change-me``) rather than a real one."""
    return value is not None and value.strip().lower() in PLACEHOLDERS


def redis_url(url: str, password: str | None = None) -> str:
    """``url`` with ``password`` percent-quoted into it (unless the URL has one already) and,
    for ``rediss://``, ``ssl_cert_reqs=required`` unless the URL says otherwise.

    A password holding ``/``, ``#`` or ``?`` written raw into a URL ends the host part early
    (and the rest turns up in logs); quoted, redis-py and kombu unquote it when they connect.
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if password is not None and parts.password is None:
        user, _, hostport = netloc.rpartition("@")
        netloc = f"{user}:{quote(password, safe='')}@{hostport}"
    query = parts.query
    if parts.scheme == "rediss" and "ssl_cert_reqs" not in dict(parse_qsl(query)):
        query = urlencode([*parse_qsl(query), ("ssl_cert_reqs", "required")])
    out = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if parts.scheme == "unix" and not netloc:
        # urlunsplit writes unix:/path for an empty host; redis-py wants unix:///path.
        out = "unix://" + out.removeprefix("unix:")
    return out


def broker_url(url: str) -> str:
    """The Redis URL as kombu (Celery's broker) spells it: a Unix socket ``unix:///path`` is
    kombu's ``redis+socket:///path``; any other URL is kept as it is."""
    if url.startswith("unix://"):
        return "redis+socket://" + url.removeprefix("unix://")
    return url


def refuse_placeholder(name: str, value: str | None) -> None:
    """Raise ValueError (naming ``name``, never the value) if ``value`` is a placeholder."""
    if is_placeholder(value):
        raise ValueError(f"{name} is still the placeholder from .env.example: set a real "
                         "secret in .env (openssl rand -hex 24)")


class SimSettings(BaseSettings):
    """Knobs of the engine simulator (``python -m workers.sim``)."""

    model_config = SettingsConfigDict(env_prefix="FLEET_SIM_", extra="ignore",
                                      env_ignore_empty=True)

    # How many times faster than real time the simulator runs (step times are divided by it).
    speed: float = 1.0
    # Mean output length of the long-tailed output distribution (docs/workload.md: ~2,490 tokens).
    mean_output_tokens: float = 2490.0
    # Shape of the log-normal output-length distribution (sigma of the underlying normal).
    output_sigma: float = 0.8
    # GPUs of the simulated node (0 .. gpus-1): a worker whose queue names another GPU is
    # refused, as NVML's device count bounds a real node's (workers/node/gpu_group.py).
    gpus: int = 8
    # Total memory of the simulated GPU in MiB (docs/workload.md: B200, 183,359 MiB).
    gpu_memory_mib: int = 183_359
    # Seed for the output-length draws, so a run can be replayed.
    seed: int | None = None
    # Real seconds the simulated engine spends "loading weights" before /health turns 200.
    startup_s: float = 1.0
    # The SGLang release the simulator plays (its /server_info version and version-specific lines).
    sglang_version: str = "0.5.11"
    # Timing profile (workers/sim/calibration.py, docs/simulator.md): "b200-workload" (the real
    # job, MTP accept ~3.5) or "h200-dummy" (real SGLang 0.5.11 on one H200, dummy weights,
    # accept ~1.0); its GPU memory and start-up time apply unless set above.
    calibration: str = "b200-workload"
    # What the answers say (workers/sim/answers.py): normal, near-empty, no-reasoning or
    # markers (the reasoning left in the content between <think> tags).
    answer: str = "normal"


class S3Settings(BaseSettings):
    """Object-store access beyond the standard AWS environment (credentials stay in AWS_*)."""

    model_config = SettingsConfigDict(env_prefix="FLEET_S3_", extra="ignore",
                                      env_ignore_empty=True)

    # Endpoint of an S3-compatible store (MinIO, moto); None (or empty) means AWS itself.
    endpoint_url: str | None = None
    region: str | None = None

    @field_validator("endpoint_url", "region", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        """An empty value in .env (``S3_ENDPOINT_URL=``) means "not set": AWS S3."""
        return None if value == "" else value
    # Managed transfers: objects above the threshold go up (and down) in parts of chunk bytes.
    multipart_threshold_bytes: int = 64 * 2**20
    multipart_chunk_bytes: int = 16 * 2**20


class Settings(BaseSettings):
    """The fleet's settings; every field can be set as ``FLEET_<NAME>``."""

    # Empty values count as unset: the compose file passes every FLEET_* as ${FLEET_X:-}.
    # Errors never echo the input (it holds the Redis URL and password).
    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore", env_ignore_empty=True,
                                      hide_input_in_errors=True)

    # --- where things live ---------------------------------------------------------------
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    # Redis' password, quoted into redis_url when that has none (FLEET_REDIS_PASSWORD, or the
    # REDIS_PASSWORD of .env that the compose/Procfile Redis is started with).
    redis_password: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("FLEET_REDIS_PASSWORD", "REDIS_PASSWORD",
                                                    "redis_password"))
    # Seconds a starting worker waits for Redis to answer; still unreachable, it prints one
    # line and exits 4 (a supervisor or the operator starts it again once Redis is up).
    redis_startup_wait_s: float = 30.0
    # Result/staging store: file:///abs/path (embedded default) or s3://bucket/prefix.
    store_url: str = Field(default_factory=_default_store_url)
    # enqueue refuses a store on this node (a folder, MinIO on the node: lost when a rented
    # node is returned) unless this is set (workers/dataset/location.py).
    allow_node_local_store: bool = False
    # Quality gates every new job starts from, as enqueue --quality takes them, comma-separated
    # ("near_empty=2%,truncated=10%"; docs/output.md); a job's own --quality wins.
    quality: str | None = None
    # A running job's live quality warning needs this many measured rows first
    # (workers/delivery/quality_live.py).
    quality_early_rows: int = 200

    # --- engine -------------------------------------------------------------------------
    engine: Literal["sglang", "sim"] = "sim"
    # Name of a TOML launch profile under config/profiles/ (without .toml), or a path.
    profile: str = "qwen36-27b"
    # The worker's GPU or GPU group when no queue names one (``2``, ``0-1``, ``0+1``; spelled
    # as queue names, workers/node/gpu_group.py); a queue that names other GPUs is refused.
    gpu: str | None = None
    # CUDA_VISIBLE_DEVICES of the engine; default: the group's GPU indices. A container that
    # reserves N GPUs sees them as devices 0..N-1 whatever their host indices: set
    # FLEET_CUDA_DEVICE=0 (or 0,1 for a group of two) there.
    cuda_device: str | None = None
    # Engine port = engine_base_port + the group's first GPU index; bound to engine_host.
    engine_base_port: int = 30000
    engine_host: str = "127.0.0.1"
    # A 54 GB model load takes minutes: this bounds start-up, it is not a hang detector.
    engine_start_timeout_s: float = 1800.0
    engine_health_interval_s: float = 2.0
    # Consecutive failed health probes before the engine is restarted; SGLang's own health
    # generation gives up after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT).
    engine_unhealthy_after: int = 3
    engine_probe_timeout_s: float = 20.0
    # No token progress for this long while requests are running means the engine hangs.
    engine_stall_timeout_s: float = 300.0
    engine_stop_grace_s: float = 30.0
    # Folder for per-GPU engine logs.
    log_dir: Path = Path("logs")

    # --- batch task -----------------------------------------------------------------------
    # In-flight requests per batch = effective running cap * headroom (+ 1).
    client_headroom: float = 1.25
    # Explicit client concurrency per batch (overrides the cap-derived value).
    client_concurrency: int | None = None
    # Batches a worker may hold at once (its pool's processes): the elastic hold
    # (workers/delivery/hold.py) takes one more only while those it holds have nothing left to
    # send, so this bounds memory and Redis (batch size x answer size x batches), not the pace.
    batches_per_gpu: int = 8
    # At the job's end a GPU with room takes the unsent rows of a batch another GPU holds
    # (workers/delivery/split.py) when at least this many would move; 0 turns splits off.
    split_min_rows: int = 4
    request_timeout_s: float = 3600.0
    # Transient request errors: attempts and backoff (seconds).
    retry_max_attempts: int = 5
    retry_base_s: float = 1.0
    retry_max_s: float = 30.0
    # Store calls (results, staged inputs) retry this often, backing off up to the cap.
    store_retry_attempts: int = 10
    store_retry_max_s: float = 30.0
    # How long a batch waits for its engine to come back before handing the batch back (its
    # answered prompts kept); meanwhile the worker takes no new batch.
    engine_wait_s: float = 60.0
    # A prompt in flight at this many engine crashes is quarantined as poison.
    poison_crashes: int = 3
    # A batch whose pool process died this many times is quarantined instead of requeued.
    batch_child_deaths: int = 3

    # --- delivery ---------------------------------------------------------------------------
    # The lease: a live worker renews its batches every lease_renew_s; a dead one's come back
    # after visibility_timeout_s plus at most one sweep period.
    visibility_timeout_s: int = 30
    lease_renew_s: float = 5.0
    sweep_interval_s: float = 5.0
    # Every fleet Redis call fails after this long on a dead connection (then reconnects).
    redis_socket_timeout_s: float = 5.0
    # No lease renewal for this long: the worker stops taking batches until renewals work.
    lease_watchdog_s: float = 15.0
    # One worker of the fleet resends lost batches of running jobs this often (a batch lost in
    # two rounds in a row, workers/delivery/janitor.py); 0 turns it off.
    reconcile_interval_s: float = 60.0
    task_time_limit_s: int = 6 * 3600
    heartbeat_interval_s: float = 5.0

    # --- observability (workers/observe/metrics.py, workers/observe/events.py) ----------------
    # Each worker's Prometheus exporter listens on metrics_host:(metrics_base_port + GPU).
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_base_port: int = 9360
    # "Recent" output tokens/s (heartbeat, Flower, status) is measured over this window.
    rate_window_s: float = 60.0
    # A running batch sends at most one task-progress event (Flower) per this interval.
    progress_event_interval_s: float = 2.0

    # --- producer -------------------------------------------------------------------------
    batch_size: int = 500

    # --- sink (workers/dataset/sink.py) -----------------------------------------------------------
    # A data-set shard is closed at the first batch boundary where its Parquet file reaches
    # shard_target_bytes or it holds shard_rows rows.
    shard_target_bytes: int = 256 * 2**20
    shard_rows: int = 1_000_000
    # Uncompressed row bytes buffered per Parquet row group.
    shard_row_group_bytes: int = 64 * 2**20
    # Enqueue fleet.sink_job when a job's last batch is done (see workers/wiring/sink_task.py).
    sink_auto: bool = True
    # GPU workers also consume the sink queue, so the data set is built where no sink worker
    # runs (one `celery -A workers worker -Q gpu0`); off where a sink worker must take it alone.
    sink_on_gpu_workers: bool = True

    sim: SimSettings = Field(default_factory=SimSettings)
    s3: S3Settings = Field(default_factory=S3Settings)

    @model_validator(mode="after")
    def _redis_auth(self) -> Settings:
        """Quote the password into the Redis URL; refuse a placeholder password."""
        password = self.redis_password.get_secret_value() if self.redis_password else None
        url = redis_url(self.redis_url.get_secret_value(), password)
        used = urlsplit(url).password
        refuse_placeholder("the Redis password (REDIS_PASSWORD or the one in FLEET_REDIS_URL)",
                           unquote(used) if used else None)
        self.redis_url = SecretStr(url)
        return self

    def redis_client_options(self) -> dict[str, object]:
        """Options of the fleet's own Redis clients (leases, progress, heartbeats): a half-open
        connection fails within seconds instead of blocking a lease renewal for minutes."""
        return {"socket_timeout": self.redis_socket_timeout_s,
                "socket_connect_timeout": self.redis_socket_timeout_s,
                "socket_keepalive": True, "health_check_interval": 10,
                "retry_on_timeout": True}

    def engine_port(self, gpu: int) -> int:
        """Port of the engine that serves GPU ``gpu``."""
        return self.engine_base_port + gpu


def load_settings() -> Settings:
    """Read the settings from the environment (call once per process and pass it down)."""
    return Settings()
