"""scripts/lookup_tree_sim.py on hand-made plain runs whose outputs repeat their prompts."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lookup_tree_sim.py"


def simulate(tmp_path, records, *args):
    path = tmp_path / "bench.json"
    # Verification costs 1 + 0.01 (m - 1) target steps for m rows.
    calibration = {"r": [1.0 + 0.01 * m for m in range(16)]}
    path.write_text(json.dumps({"calibration": calibration, "records": records}), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {}
    for line in out.splitlines():
        words = line.split()
        rows[words[0]] = (float(words[2].rstrip("x")), float(words[-1].rstrip("x")))
    return rows


def record(category, prompt, output, mode="ar"):
    return {
        "category": category,
        "mode": mode,
        "prompt_tokens": prompt,
        "output_tokens": output,
    }


def test_a_second_branch_pays_only_where_the_first_fails(tmp_path):
    # "copy": the output copies the prompt's only continuation of "1 2": one branch is enough, and
    # the tree drafts the same. "fork": "0 1 2" was followed by "3 4 5 6" and later by "7 8 9 10"
    # (the newer ranks first), and the output takes the older one, which only the tree's second
    # branch drafts.
    copy_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
    fork_prompt = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 7, 8, 9, 10, 0, 1, 2]
    rows = simulate(
        tmp_path,
        [
            record("copy", copy_prompt, [3, 4, 5, 6, 7, 8, 9, 10, 11]),
            record("fork", fork_prompt, [3, 4, 5, 6, 0]),
            # Only plain runs are replayed.
            record("other", copy_prompt, [3, 4], mode="hybrid"),
        ],
        "--len",
        4,
    )
    assert set(rows) == {"copy", "fork"}
    chain, tree = rows["copy"]
    assert chain > 1.5 and abs(tree - chain) < 1e-9
    # The chain is rejected at once and needs a second round; the tree takes all in one.
    chain, tree = rows["fork"]
    assert tree > 1.5 * chain
