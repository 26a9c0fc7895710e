"""Issue 27: N samples per prompt against the same prompts written out N times.

One worker with a simulated engine (the qwen36-27b profile, metrics on) runs two jobs of the
same P prompts, the engine's radix cache flushed (``/flush_cache``) before each:

- ``samples``: the P prompts with ``--samples 8``;
- ``copies``: the P prompts written 8 times each (each row repeated in place, the workaround a
  user without ``--samples`` writes).

Measured from the engine, not assumed: its ``sglang:realtime_tokens_total`` counters
(``mode="prefill_compute"``: prompt tokens the engine computed; ``mode="decode"``: tokens it
generated) read before and after each job, the prompts' own tokens as the engine reported them
(``prompt_tokens`` of each prompt's sample 0), and each job's wall time from ``enqueue`` until
``status`` says done. ``bench/gpu_check.py --samples-vs-copies P`` runs the same comparison on
real SGLang engines. Goals: the samples job's whole-job tokens/s >= 1.0 x the copies job's,
and its prefill tokens computed <= 1.1 x the P prompts' own tokens (the copies job computes up
to 8 x).

On a hybrid (Mamba) model the radix cache can only resume a prompt where a recurrent state was
saved: under ``extra_buffer`` every ``--mamba-track-interval`` tokens (256 by default;
``mem_cache/mamba_radix_cache.py``), so each sample recomputes up to 255 tokens of its
prompt's tail whether it reuses the prefill through the fleet's own prefill request or through
SGLang's ``n``. ``--track-interval N`` runs the same profile with ``--mamba-track-interval N``
(a profile file written under the run's folder) to show that cost apart.

``python -m bench.samples [--prompts 48] [--samples 8] [--track-interval 16]``
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import httpx
import orjson

from bench.common import (
    PROFILE,
    ROOT,
    VERIFY_ROWS_OK,
    Fleet,
    Goal,
    _corpus,
    local_fleet,
    note,
    verdict,
)
from bench.engines import parse_counter
from workers.sim.textgen import count_chat_tokens

PROMPT_CHARS = 8000  # ~2,000 tokens at the simulator's 4 characters per token


def write_prompts(path: Path, n: int, copies: int = 1, seed: int = 3) -> int:
    """P chat prompts of ~2,000 tokens, each row ``copies`` times in a row; return the P
    prompts' own tokens (as the engine counts them)."""
    rng = random.Random(seed)
    corpus = _corpus(rng, n * PROMPT_CHARS + 2**16)
    tokens = 0
    with path.open("wb") as fh:
        for i in range(n):
            start = rng.randrange(len(corpus) - PROMPT_CHARS)
            messages = [{"role": "user", "content": f"Problem {i}: "
                         + corpus[start:start + PROMPT_CHARS]}]
            tokens += count_chat_tokens(messages)
            for c in range(copies):
                fh.write(orjson.dumps({"id": f"q{i}-{c}", "messages": messages}) + b"\n")
    return tokens


def counters(urls: list[str]) -> dict[str, float]:
    """The engines' prefill-computed, prefill-cached and decode token counters, summed."""
    out = dict.fromkeys(("prefill_compute", "prefill_cache", "decode"), 0.0)
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for mode in out:
            out[mode] += parse_counter(text, "sglang:realtime_tokens_total", f'mode="{mode}"')
    return out


def own_prompt_tokens(fleet: Fleet, job: str) -> int:
    """The prompts' own tokens as the engine counted them: ``prompt_tokens`` of each prompt's
    sample 0 in the stored results."""
    results = fleet.workdir / "store" / "jobs" / job / "results"
    return sum(int(row.get("prompt_tokens") or 0) for f in sorted(results.glob("*.jsonl"))
               for line in f.read_bytes().splitlines()
               if not (row := orjson.loads(line)).get("sample"))


def run(fleet: Fleet, urls: list[str], path: Path, job: str, max_new_tokens: int,
        *extra: str) -> dict[str, float]:
    """Flush the engines' caches, run one job to its end, return what the engines counted."""
    for url in urls:
        assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
    before = counters(urls)
    t0 = time.monotonic()
    fleet.producer("enqueue", str(path), "--job", job, "--batch-size", "64",
                   "--max-new-tokens", str(max_new_tokens), "--temperature", "0.8", *extra)
    while True:
        st = orjson.loads(fleet.producer("status", "--job", job, "--json").stdout)
        if st["done"]:
            break
        time.sleep(0.5)
    wall = time.monotonic() - t0
    report = orjson.loads(fleet.producer("verify", "--job", job, "--json",
                                        ok_codes=VERIFY_ROWS_OK).stdout)
    after = counters(urls)
    got = {k: after[k] - before[k] for k in after}
    got.update(wall_s=wall, tok_s=got["decode"] / wall, rows=report["rows"],
               verified=float(report["ok"]))
    note(f"{job}: {report['rows']} rows in {wall:.1f} s, {got['tok_s']:,.0f} decode tok/s, "
         f"prefill computed {got['prefill_compute']:,.0f}, from cache "
         f"{got['prefill_cache']:,.0f}, verify ok: {report['ok']}")
    return got


def compare(fleet: Fleet, urls: list[str], prompts: int, samples: int,
            max_new_tokens: int = 1200) -> dict[str, float]:
    """Both jobs on the fleet's running engines; the figures the goals are checked on."""
    work = fleet.workdir
    write_prompts(work / "samples-prompts.jsonl", prompts)
    write_prompts(work / "samples-copies.jsonl", prompts, copies=samples)
    stamp = time.strftime("%H%M%S")
    one = run(fleet, urls, work / "samples-prompts.jsonl", f"samples-{stamp}", max_new_tokens,
              "--samples", str(samples))
    own = own_prompt_tokens(fleet, f"samples-{stamp}")
    copies = run(fleet, urls, work / "samples-copies.jsonl", f"copies-{stamp}", max_new_tokens)
    note(f"the {prompts} prompts' own tokens (the engine's prompt_tokens): {own:,}")
    return {"prompts": prompts, "samples": samples, "own_prompt_tokens": own,
            "tok_s_ratio": one["tok_s"] / copies["tok_s"],
            "prefill_ratio_samples": one["prefill_compute"] / own,
            "prefill_ratio_copies": copies["prefill_compute"] / own,
            "verified": min(one["verified"], copies["verified"]),
            "samples_job": one, "copies_job": copies}


def goals(got: dict[str, float]) -> list[Goal]:
    """The issue's goals on the figures of :func:`compare`."""
    return [
        Goal("whole-job tokens/s, samples / copies", got["tok_s_ratio"], 1.0, "x"),
        Goal("prefill computed / prompt tokens (samples)", got["prefill_ratio_samples"],
             1.1, "x", at_most=True),
        Goal("prefill computed / prompt tokens (copies; bound, not a goal)",
             got["prefill_ratio_copies"], float(got["samples"]), "x", at_most=True),
        Goal("every sample verified exactly once (both jobs)", got["verified"], 1.0),
    ]


def main() -> int:
    """Run both jobs and print the ratios beside their goals."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--speed", default="20")
    ap.add_argument("--track-interval", type=int, default=None,
                    help="run qwen36-27b with this --mamba-track-interval instead of 256")
    args = ap.parse_args()
    with local_fleet("samples", FLEET_SIM_SPEED=args.speed,
                     FLEET_SIM_MEAN_OUTPUT_TOKENS="400") as fleet:
        work = fleet.workdir
        profile = PROFILE
        if args.track_interval:
            text = (ROOT / "config/profiles" / f"{PROFILE}.toml").read_text()
            text = text.replace(f'name = "{PROFILE}"', f'name = "{PROFILE}-track"').replace(
                "[flags]\n", f"[flags]\nmamba-track-interval = {args.track_interval}\n")
            (work / "profile.toml").write_text(text)
            profile = str(work / "profile.toml")
        note(f"profile {profile}")
        fleet.base_env["FLEET_PROFILE"] = profile
        fleet.start_workers(1)
        got = compare(fleet, [fleet.engine_url(0)], args.prompts, args.samples)
    track = f", --mamba-track-interval {args.track_interval}" if args.track_interval else ""
    return verdict(f"{args.prompts} prompts x {args.samples} samples vs copied rows "
                   f"({PROFILE}{track})", goals(got))


if __name__ == "__main__":
    raise SystemExit(main())
