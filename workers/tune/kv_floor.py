"""How many running requests of THIS job a KV pool holds, by SGLang's own admission arithmetic.

A candidate launch is only as good as the running count its KV pool sustains for the job
being run: a cap of 108 with 34,949 KV tokens is 108 running for the GPU check's rows of 150
output tokens and 10 for thinking traces of 2,490. SGLang's ``PrefillAdder``
(``managers/schedule_policy.py``) admits a request while

    pool - sum(held_i) - new_token_ratio * sum(min(max_new_i - decoded_i, CLIP))
        > prompt + min(max_new, CLIP) + page_size

(``rem_total_tokens`` against ``add_one_req``'s ``total_tokens``, 0.5.11; 0.5.10.post1 has no
page term; ``CLIP`` is ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``), and the ratio decays to its
floor while nothing is retracted. With ``n`` running requests of a job each holding ``held``
tokens on average and budgeted ``reserved``, the ``(n + 1)``-th is admitted while
``n * (held + ratio * reserved) < pool - newcomer``: the pool holds
``ceil((pool - newcomer) / (held + ratio * reserved))``.

What a running request holds on average over the job (Little's law over the pool's tokens) is
its prompt plus ``E[O^2] / (2 E[O])`` of its output: long requests run longer, so they are
over-represented among those running. Only for outputs of one length is that
``prompt + output / 2`` (:func:`workers.engine.capacity.steady_kv_per_request`, used for the
context bound); with only the mean known the spread is assumed geometric (``held_per_request``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine import capacity
from workers.engine.admission import admission_tokens, newcomer_tokens

# Where the per-request figures came from, most to least trustworthy.
BASIS_JOB = "job"  # the fleet's job record: its max_new_tokens and its completed rows
BASIS_CONTEXT = "context"  # every request assumed to run to the engine's --context-length
BASIS_HELD = "held_lower_bound"  # what requests held when the snapshot was taken


@dataclass(frozen=True)
class KvNeed:
    """What one running request of a job asks of the KV pool."""

    prompt: float  # mean prompt tokens
    held: float  # KV tokens a running request holds, averaged over the job
    max_new: int  # the requests' max_new_tokens (what admission budgets for)
    basis: str
    source: str

    @property
    def reserved(self) -> float:
        """Mean output budget a running request is charged (``max_new - decoded``, clipped)."""
        decoded = max(self.held - self.prompt, 0.0)
        return min(max(self.max_new - decoded, 0.0), capacity.CLIP_MAX_NEW_TOKENS)

    def newcomer(self) -> float:
        """``add_one_req``'s ``total_tokens`` for a fresh request of this job."""
        return newcomer_tokens(self.prompt, self.max_new)

    def per_running(self, ratio: float) -> float:
        """Pool tokens each running request takes from admission's room at ``ratio``."""
        return admission_tokens(self.held, self.reserved, ratio)

    def describe(self) -> str:
        """``~2,500 tokens`` and what the figure is, for reasons."""
        what = {BASIS_JOB: "this job's", BASIS_CONTEXT: "context-length",
                BASIS_HELD: "held-now (a lower bound)"}[self.basis]
        return f"{what} ~{self.held:,.0f} tokens"


def floor_ratio(conservativeness: float = 1.0) -> float:
    """``new_token_ratio`` once it has decayed (no retraction): SGLang's most optimistic."""
    return capacity.NewTokenRatio.from_conservativeness(conservativeness).floor


def kv_held_requests(pool_tokens: int, need: KvNeed, ratio: float | None = None) -> int:
    """Running requests of ``need``'s job that ``pool_tokens`` KV tokens admit and hold."""
    room = pool_tokens - need.newcomer()
    if room <= 0:
        return 0
    per = need.per_running(floor_ratio() if ratio is None else ratio)
    return math.ceil(room / per) if per > 0 else 0


def held_per_request(prompt: float, output_mean: float, output_sq_mean: float | None,
                     max_new: int) -> float:
    """KV tokens a running request holds averaged over the job: ``prompt + E[O^2] / (2 E[O])``.

    Without the second moment of the output lengths, their spread is taken as a geometric
    one's (``E[O^2] = 2 E[O]^2``: generation stops at EOS with a steady chance per token), and
    never past ``max_new / 2`` (every output at ``max_new``, the most ``E[O^2]`` allows).
    """
    if output_mean <= 0:
        return prompt
    sq = output_sq_mean if output_sq_mean else 2 * output_mean * output_mean
    half = min(sq / (2 * output_mean), max(max_new, output_mean) / 2)
    return prompt + max(half, output_mean / 2)


def need_from_job(job: Mapping[str, Any], context_len: int,
                  prompt_fallback: float | None = None) -> KvNeed | None:
    """The need from a snapshot's ``job`` section (:mod:`workers.tune.job_lengths`), or None
    when it names no output length."""
    output = job.get("output_tokens_mean")
    max_new = job.get("max_new_tokens")
    prompt = job.get("prompt_tokens_mean")
    prompt = float(prompt if prompt is not None else prompt_fallback or 0.0)
    limit = max(context_len - math.ceil(prompt), 1)
    max_new = min(int(max_new), limit) if max_new else limit
    if not output:
        if not job.get("max_new_tokens"):
            return None
        output, sq, how = float(max_new), float(max_new) ** 2, \
            "no completed rows: every row to max_new_tokens"
    else:
        sq = job.get("output_tokens_sq_mean")
        rows = job.get("rows") or job.get("completed")
        how = (f"{job.get('output_source', 'completed rows')}: mean output {output:,.0f} over "
               f"{rows} rows" + (", their spread measured" if sq else ", spread assumed "
                                 "geometric (E[O^2] = 2 E[O]^2, at most max_new / 2)"))
    held = held_per_request(prompt, float(output), sq, max_new)
    name = job.get("name", "?")
    source = (f"job {name}: {how}; prompt {prompt:,.0f}, max_new_tokens {max_new:,} "
              f"(SGLang budgets min(max_new, {capacity.CLIP_MAX_NEW_TOKENS}) at admission)")
    return KvNeed(prompt, held, max_new, BASIS_JOB, source)


def need_from_context(context_len: int, prompt: float = 0.0) -> KvNeed:
    """The conservative bound: every request runs to the context."""
    output = max(context_len - prompt, 1.0)
    return KvNeed(prompt, capacity.steady_kv_per_request(prompt, output), int(output),
                  BASIS_CONTEXT,
                  f"no job lengths readable: every request assumed to run to --context-length "
                  f"{context_len:,} (the conservative bound)")


def need_from_lengths(prompt: float, output_mean: float, max_new: int | None,
                      context_len: int) -> KvNeed:
    """The need of a job given by its lengths (``tune plan --avg-output-tokens``)."""
    job = {"name": "planned", "prompt_tokens_mean": prompt, "output_tokens_mean": output_mean,
           "max_new_tokens": max_new, "output_source": "given", "rows": "planned"}
    need = need_from_job(job, context_len)
    assert need is not None
    return need
