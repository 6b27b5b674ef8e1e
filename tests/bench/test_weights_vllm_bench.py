"""``hixl bench --scenario weights-vllm``, run for real in its ``--quick`` form (vLLM starts: slow).

It checks the rows, never speed: hixl's time to the first token with the reload as its
baseline, and the reload's own row. The tokens after every switch are checked by the
scenario itself against transformers' (a mismatch raises, and ``main`` would not return 0).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from hixl.bench.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_rows_with_their_baseline_after_checked_switches(tmp_path: Path) -> None:
    path = tmp_path / "quick.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--scenario", "weights-vllm", "--quick", "--no-progress", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = {r["op"]: r for r in doc["rows"]}
    assert set(rows) == {"hixl update_weights", "vLLM reload_weights (safetensors)"}, rows
    hixl, reload = rows["hixl update_weights"], rows["vLLM reload_weights (safetensors)"]
    assert hixl["unit"] == reload["unit"] == "ms" and hixl["value"] > 0 and reload["value"] > 0
    assert hixl["baseline"] == reload["value"] and hixl["ratio"] == pytest.approx(hixl["value"] / reload["value"])
    assert any("checked against transformers" in n for n in doc["notes"]), doc["notes"]
    assert "weights-vllm" in out.getvalue()
