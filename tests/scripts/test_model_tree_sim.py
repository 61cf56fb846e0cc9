"""scripts/model_tree_sim.py on hand-made draft predictions."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_tree_sim.py"


def simulate(tmp_path, records):
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    bench = tmp_path / "bench.json"
    # A draft token costs 0.1 target steps; verification 1 + 0.01 (m - 1) for m rows.
    calibration = {"c": 0.1, "r": [1.0 + 0.01 * m for m in range(16)]}
    bench.write_text(json.dumps({"calibration": calibration}), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(predictions), str(bench)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {}
    for line in out.splitlines()[2:]:
        words = line.split()
        rows[words[0]] = (float(words[1]), float(words[2]), float(words[3]), float(words[-1]))
    return rows


def record(category, output, pred, conf, pred2, conf2):
    n = len(output) + 1
    return {
        "category": category,
        "output": output,
        "pred": (pred + [0])[:n],
        "conf": (conf + [0.9])[:n],
        "pred2": (pred2 + [0])[:n],
        "conf2": (conf2 + [0.0])[:n],
    }


def test_a_sibling_pays_only_where_the_draft_second_choice_is_right(tmp_path):
    answer = list(range(100, 140))
    wrong = [t + 1000 for t in answer]
    rows = simulate(
        tmp_path,
        [
            # The draft's first choice is always right and sure: siblings (never likely) add nothing.
            record("sure", answer, answer, [0.95] * 40, wrong, [0.01] * 40),
            # Its first choice is always wrong and its second always right, both near one half: a
            # chain accepts nothing, a tree one sibling a round.
            record("second", answer, wrong, [0.5] * 40, answer, [0.45] * 40),
        ],
    )
    assert set(rows) == {"sure", "second", "all"}
    top1, top2, chain, gain = rows["sure"]
    assert top1 == 1.0 and chain > 3.0 and abs(gain - 1.0) < 1e-3
    top1, top2, chain, gain = rows["second"]
    assert top1 == 0.0 and top2 == 1.0
    # Plain decoding's rate: one token per step.
    assert abs(chain - 1.0) < 1e-9
    # Two tokens (the sibling and the target's next) per c + r(3) = 1.12 target steps.
    assert abs(gain - 2 / 1.12) < 1e-2
