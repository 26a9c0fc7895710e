"""The exports loaded with SpecForge's own data code, in the venv tools/loaders_venv.sh makes.

SpecForge's ``GeneralParser`` / ``ThinkingParser`` (``specforge/data/parse.py``) parse each
line of the ``specforge`` export with its registered ``qwen`` template and the fixture
tokenizer; the test checks that no conversation is truncated (SpecForge warns and cuts a
conversation whose roles are out of order) and that its ``input_ids`` and ``loss_mask`` equal
the ``tokens`` export's. Skipped, with the reason, where the venv is not there (SpecForge and
speculators need torch: several GB, not installed by ``make test``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_export_trainers import TOKENIZER, _job

VENV = Path(os.environ.get("LOADERS_VENV", "/tmp/loaders-venv"))
SCRIPT = r"""
import json, sys, warnings
import pyarrow.parquet as pq
from transformers import AutoTokenizer
from specforge.data.parse import ThinkingParser
from specforge.data.template import TEMPLATE_REGISTRY

tok = AutoTokenizer.from_pretrained(sys.argv[1])
# The engine was sent no template system prompt: SpecForge must not add one either.
template = TEMPLATE_REGISTRY.get("qwen3-thinking").model_copy(update={"system_prompt": None})
parser = ThinkingParser(tok, template)
ours = {r["id"]: r for r in pq.read_table(sys.argv[3]).to_pylist()}
out = {"rows": 0, "truncated": 0, "same": 0}
for line in open(sys.argv[2]):
    row = json.loads(line)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids, mask = parser.parse(row["conversations"], 4096, tool=row.get("tools") or [])
    out["rows"] += 1
    out["truncated"] += any("truncated" in str(w.message) for w in caught)
    mine = ours[row["id"]]
    out["same"] += ids.tolist() == mine["input_ids"] and mask.tolist() == mine["loss_mask"]
print(json.dumps(out))
"""


def _ready() -> str | None:
    python = VENV / "bin" / "python"
    if not python.exists():
        return f"{VENV} is not there: run bash tools/loaders_venv.sh (needs torch, several GB)"
    res = subprocess.run([str(python), "-c", "import specforge.data.parse, transformers"],
                         capture_output=True, text=True)
    if res.returncode:
        return f"SpecForge does not import in {VENV}: {res.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.mark.skipif(_ready() is not None, reason=str(_ready()))
def test_specforge_parses_the_export_as_the_tokens_export_has_it(fleet_env, tmp_path, r):
    from transformers import AutoTokenizer

    from tests.test_sink import cli

    _job(fleet_env, AutoTokenizer.from_pretrained(str(TOKENIZER)))
    sf, tokens = tmp_path / "sf.jsonl", tmp_path / "tok.parquet"
    assert cli(fleet_env, "export", "--job", "tr", "--format", "specforge", "--out",
               str(sf)).returncode == 0
    assert cli(fleet_env, "export", "--job", "tr", "--format", "tokens", "--out", str(tokens),
               "--tokenizer", str(TOKENIZER)).returncode == 0
    res = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, str(TOKENIZER), str(sf),
                          str(tokens)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"rows": 10, "truncated": 0, "same": 10}
