"""scripts/compare_bench.py on small hand-made bench runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_bench.py"


def run_file(tmp_path, name, rates):
    """A bench JSON with `rates` = {(id, category): {mode: tokens/s}}."""
    records = [
        {"id": pid, "category": category, "mode": mode, "decode_tokens_per_s": rate}
        for (pid, category), modes in rates.items()
        for mode, rate in modes.items()
    ]
    path = tmp_path / name
    path.write_text(json.dumps({"records": records}), encoding="utf-8")
    return path


def compare(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_pairs_prompts_against_their_own_plain_decoding(tmp_path):
    # a: speedup 2 -> 3 (1.5x) although both modes ran slower in the new run; b: 1.5 -> 1.5;
    # c only in the base run (left out); d's category has no pair.
    base = run_file(
        tmp_path,
        "base.json",
        {
            ("a", "qa"): {"ar": 20.0, "hybrid": 40.0},
            ("b", "qa"): {"ar": 20.0, "hybrid": 30.0},
            ("c", "chat"): {"ar": 20.0, "hybrid": 30.0},
        },
    )
    new = run_file(
        tmp_path,
        "new.json",
        {
            ("a", "qa"): {"ar": 10.0, "hybrid": 30.0},
            ("b", "qa"): {"ar": 30.0, "hybrid": 45.0},
            ("d", "edit"): {"ar": 20.0, "hybrid": 50.0},
        },
    )
    out = compare(base, new)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert set(lines) == {"all", "qa"}
    expected = f"{math.sqrt(1.5):.3f}x"
    assert lines["all"] == ["all", "2", expected, "1/2"]
    assert lines["qa"] == ["qa", "2", expected, "1/2"]


def test_a_mode_missing_from_either_run_is_an_error(tmp_path):
    base = run_file(tmp_path, "base.json", {("a", "qa"): {"ar": 20.0, "model": 30.0}})
    out = compare(base, base, "--mode", "hybrid")
    assert out.returncode == 1
    assert "no prompt has mode 'hybrid'" in out.stderr


def test_repeated_runs_pair_within_their_repetition_and_take_the_median(tmp_path):
    # `bench --repeat 3`: prompt a's hybrid runs 2x, 3x, 4x its own repetition's plain run (the
    # plain runs' speeds differ), so its speedup is 3x; against the base's 2x that is 1.5x. Paired
    # with the wrong plain run, or averaged over the runs' tokens/s, it would not be.
    def repeated(name, runs):
        records = [
            {"id": "a", "category": "qa", "mode": mode, "repeat": i, "decode_tokens_per_s": rate}
            for i, modes in enumerate(runs)
            for mode, rate in modes.items()
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"records": records}), encoding="utf-8")
        return path

    base = repeated("base.json", [{"ar": 20.0, "hybrid": 40.0}])
    new = repeated(
        "new.json",
        [
            {"ar": 10.0, "hybrid": 20.0},
            {"ar": 30.0, "hybrid": 90.0},
            {"ar": 5.0, "hybrid": 20.0},
        ],
    )
    out = compare(base, new)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert lines["all"] == ["all", "1", "1.500x", "1/1"]
