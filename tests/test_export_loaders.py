"""The token exports read by SpecForge's and vLLM speculators' own code, as installed from the
package registry (tools/trainers.lock, in the venv tools/trainers_venv.sh builds and
``make test`` caches; FLEET_TRAINERS_VENV names it).

For every row kind under every chat template of :mod:`tests.trainer_rows`:

- SpecForge: the ``specforge`` export through its training entry point's prompt preparation
  (``specforge/training/assembly.py::_prepare_prompts`` calls
  ``specforge/data/prompt_builder.py::prepare_prompt_tasks`` with the config's data options;
  here its stock ``qwen3-thinking`` template, which the pre-tokenized rows never reach);
- speculators: the ``speculators`` export through ``speculators prepare-data``
  (``speculators/cli/prepare_data.py::prepare_data``), then the dataset its training opens
  (``speculators/train/data.py::ArrowDataset``: ``datasets.load_from_disk``).

The ``input_ids`` and ``loss_mask`` each builds must be the engine's: the context it was sent,
mask 0, then the ids it generated, mask 1. Not skipped: without the venv the test fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_sink import cli
from tests.trainer_rows import TEMPLATES, make_trainer_job, tokenizer_folder

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "tools" / "trainers.lock"
SCRIPT = r"""
import json, sys
from datasets import load_from_disk
from transformers import AutoTokenizer
from specforge.data.prompt_builder import prepare_prompt_tasks
from speculators.cli.prepare_data import prepare_data

out = {}
for case in json.loads(sys.argv[1]):
    tok = AutoTokenizer.from_pretrained(case["tokenizer"])
    tasks = prepare_prompt_tasks(
        case["specforge"], tok, chat_template="qwen3-thinking", max_length=4096,
        is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
        num_proc=1)
    sf = [[t["payload"]["input_ids"], t["payload"]["loss_mask"]] for t in tasks]
    prepare_data(model=case["tokenizer"], data=[case["speculators"]], output=case["prepared"],
                 seq_length=4096, num_preprocessing_workers=1)
    ds = load_from_disk(case["prepared"])
    sp = [[list(map(int, r["input_ids"])), list(map(int, r["loss_mask"]))] for r in ds]
    out[case["template"]] = {"specforge": sf, "speculators": sp}
print("RESULT " + json.dumps(out))
"""


def trainers_python() -> Path:
    """The venv's python: FLEET_TRAINERS_VENV, else where tools/trainers_venv.sh puts it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]
    venv = Path(os.environ.get("FLEET_TRAINERS_VENV")
                or cache / "gpu-batch-fleet" / f"trainers-{digest}")
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        pytest.fail(f"no trainers venv at {venv}: run bash tools/trainers_venv.sh "
                    "(make test does)")
    return python


def test_specforge_and_speculators_train_on_the_engine_s_tokens(fleet_env, tmp_path, r):
    import transformers

    python = trainers_python()
    cases, truths = [], {}
    for template in TEMPLATES:
        folder = tokenizer_folder(tmp_path, template)
        tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        job = f"kinds-{template}"
        truths[template] = make_trainer_job(fleet_env, tok, job)
        assert cli(fleet_env, "sink", "--job", job, "--local").returncode == 0
        case = {"template": template, "tokenizer": str(folder),
                "prepared": str(tmp_path / f"prepared-{template}")}
        for fmt in ("specforge", "speculators"):
            case[fmt] = str(tmp_path / f"{template}-{fmt}.jsonl")
            res = cli(fleet_env, "export", "--job", job, "--format", fmt, "--out", case[fmt],
                      "--tokenizer", str(folder), "--max-differ", "0.2")
            assert res.returncode == 0, res.stderr
        cases.append(case)
    res = subprocess.run([str(python), "-c", SCRIPT, json.dumps(cases)], capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                              "TOKENIZERS_PARALLELISM": "false"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.split("RESULT ", 1)[1])
    for template, truth in truths.items():
        want = sorted([ids, mask] for ids, mask in truth.values())
        # SpecForge keeps the file's order; speculators shuffles: compare as multisets.
        assert len(got[template]["specforge"]) == len(truth) == 16
        assert sorted(got[template]["specforge"]) == want, template
        assert sorted(got[template]["speculators"]) == want, template
