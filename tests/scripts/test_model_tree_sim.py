"""scripts/model_tree_sim.py on hand-made draft predictions."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_tree_sim.py"


def load():
    spec = importlib.util.spec_from_file_location("model_tree_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def r(m):
    # Verification costs 1 + 0.01 (m - 1) target steps for m rows.
    return 1.0 + 0.01 * (m - 1)


def simulate(tmp_path, records):
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    bench = tmp_path / "bench.json"
    # A draft pass costs 0.1 target steps.
    calibration = {"c": 0.1, "r": [r(m) for m in range(1, 17)]}
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
            # The draft's first choice is always right and sure: siblings (never likely) add
            # nothing.
            record("sure", answer, answer, [0.95] * 40, wrong, [0.01] * 40),
            # Its first choice is always wrong and its second always right, both near one half: a
            # chain accepts nothing, a tree one sibling a round.
            record("second", answer, wrong, [0.5] * 40, answer, [0.45] * 40),
            # An empty answer is left out.
            record("empty", [], [], [], [], []),
        ],
    )
    assert set(rows) == {"sure", "second", "all"}
    top1, top2, chain, gain = rows["sure"]
    assert top1 == 1.0 and chain > 3.0 and gain == 1.0
    top1, top2, chain, gain = rows["second"]
    assert top1 == 0.0 and top2 == 1.0
    # Plain decoding (k = 0) is the best chain: one token per step.
    assert chain == 1.0
    # Two tokens (the sibling and the target's next) per c + r(3) = 1.12 target steps.
    assert abs(gain - 2 / 1.12) < 1e-3


def test_extensions_confidence_stops_and_the_answers_end_are_priced_round_by_round():
    rate = load().rate
    answer = list(range(12))
    # Every third position (0, 3, 6, 9) the draft's first choice is wrong and unsure and its second
    # right; elsewhere its first choice is right and sure.
    miss = [i % 3 == 0 for i in answer]
    rec = record(
        "x",
        answer,
        [t + 100 if m else t for t, m in zip(answer, miss)],
        [0.5 if m else 0.9 for m in miss],
        [t if m else t + 100 for t, m in zip(answer, miss)],
        [0.45 if m else 0.01 for m in miss],
    )
    prices = {"c": 0.1, "r": r, "slope": 0.05}
    # k = 1 with siblings extended by 2: at 0 and 6 the sibling and its two extensions are
    # accepted (4 tokens with the target's next, c · 1.05 + r(5) = 1.145); at 4 and 10 the one
    # drafted token (2 tokens, c + r(2) = 1.11).
    got = rate(rec, 1, 0.0, 0.4, 2, **prices)
    assert abs(got - 12 / (2 * 1.145 + 2 * 1.11)) < 1e-12
    # k = 3 stopped where the confidence falls below 0.6, no siblings: at 0 a draft pass and a
    # plain step (1.1); at 1, 4 and 7 two tokens drafted and a third pass that stops (3c + r(3) =
    # 1.32, 3 tokens); at 10 two tokens drafted up to the answer's end (2c + r(3) = 1.22).
    got = rate(rec, 3, 0.6, 2.0, 0, **prices)
    assert abs(got - 12 / (1.1 + 3 * 1.32 + 1.22)) < 1e-12
    # Plain decoding costs a step a token.
    assert rate(rec, 0, 0.0, 2.0, 0, **prices) == 1.0
