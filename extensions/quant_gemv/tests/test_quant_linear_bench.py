"""benchmarks/quant_linear.py on the CPU, small: the rows it reports, the layers-in-a-row rows
included, and fusec's error against eager in them (the benchmark's numbers are for a GPU; this
keeps the script working where CI runs)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository root


def test_quant_linear_rows_and_layers_in_a_row(tmp_path):
    out = tmp_path / "ql.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/quant_linear.py", "--k", "256", "--n", "256", "--m", "1",
         "--group", "64", "--no-compile", "--in-a-row", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    for fmt in ("int8", "int4"):
        single, row = rows[f"{fmt} fusec"], rows[f"{fmt} fusec, 3 in a row"]
        assert single["err_fusec"] <= single["err_eager"] * 1.01 + 1e-6
        assert row["kernels"] == 3, row  # one GEMV kernel per layer
        assert row["rel_err"] < 1e-2, row
        assert row["ms"] > 0 and row["tbps"] == row["bytes"] / row["ms"] / 1e9
    assert rows["bf16 F.linear (cuBLAS), 3 in a row"]["ms"] > 0
    assert "3 kernels; the last layer's output against eager's" in done.stdout
