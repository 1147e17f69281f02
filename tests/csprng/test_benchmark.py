"""The benchmark's goal table and its report (no timing here: the figures come from bench/)."""

from ember.csprng import benchmark


def test_goals_are_issue_14s_by_case_and_size():
    assert benchmark._goal("rand float32", 64) == 6.0
    assert benchmark._goal("rand float32", 1) == 4.0
    assert benchmark._goal("randn float32", 64) == 2.5
    assert benchmark._goal("randn float32", 1) == 1.5
    assert benchmark._goal("randint int64", 64) == 3.0
    assert benchmark._goal("randint int64", 1) is None
    assert benchmark._goal("randperm 1e7", 76) == 2.0
    assert benchmark._goal("rand float32 fresh", 64) == 4.0
    assert benchmark._goal("randn float32 fresh", 64) == 2.0
    assert benchmark._goal("randint int64 fresh", 64) == 2.0
    assert benchmark.KEYSTREAM_SHARE_GOAL == 0.70


def test_table_says_met_or_not_with_spread_load_and_share_of_two_threads_keystream():
    rows = [
        {"case": "rand float32", "size_mib": 64, "reps": 5, "ember_gbps": 7.0, "torch_gbps": 1.0,
         "ratio": 7.0, "ratio_min": 6.5, "ratio_max": 7.5, "goal": 6.0, "load_before": 0.5,
         "load_after": 0.7, "of_keystream2": 0.65, "of_keystream2_min": 0.6,
         "of_keystream2_max": 0.7, "keystream2_gbps": 10.8, "keystream2_goal": 0.70},
        {"case": "randn float32", "size_mib": 64, "reps": 5, "ember_gbps": 2.0, "torch_gbps": 1.0,
         "ratio": 2.0, "ratio_min": 1.9, "ratio_max": 2.1, "goal": 2.5, "load_before": None,
         "load_after": None},
    ]
    lines = benchmark.format_table(rows).splitlines()
    assert "7.00x [6.50-7.50]" in lines[2] and " yes " in lines[2] and "0.5/0.7" in lines[2]
    assert "65% [60%-70%] of the two-thread keystream" in lines[3]
    assert lines[3].endswith("goal 70%: not met")
    assert "2.00x [1.90-2.10]" in lines[4] and " no " in lines[4]


def test_rows_hold_every_repetition_and_their_median_and_spread():
    row = benchmark.pair_row("rand float32", 4096 * 4,
                             lambda g: lambda: __import__("torch").rand(4096, generator=g),
                             reps=5, goal=2.0)
    assert row["reps"] == 5 and len(row["ember_s"]) == 5 and len(row["torch_s"]) == 5
    ratios = sorted(t / e for e, t in zip(row["ember_s"], row["torch_s"], strict=True))
    assert row["ratio"] == ratios[2]
    assert row["ratio_min"] == ratios[0] and row["ratio_max"] == ratios[-1]
    assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]
    assert "load_before" in row and "load_after" in row


def test_interleaved_alternates_the_functions_within_every_repetition():
    order = []
    benchmark.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                          reps=5, inner=2)
    assert order == (["a"] * 3 + ["b"] * 3) * 5  # one untimed call, then two timed, per side
