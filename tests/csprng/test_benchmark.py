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


def test_table_says_met_or_not_and_the_share_of_two_threads_keystream():
    rows = [
        {"case": "rand float32", "size_mib": 64, "ember_gbps": 7.0, "torch_gbps": 1.0, "ratio": 7.0,
         "goal": 6.0, "of_keystream": 1.1, "of_keystream2": 0.65, "keystream2_goal": 0.70},
        {"case": "randn float32", "size_mib": 64, "ember_gbps": 2.0, "torch_gbps": 1.0, "ratio": 2.0,
         "goal": 2.5},
    ]
    lines = benchmark.format_table(rows).splitlines()
    assert lines[2].split()[-1] != "no" and " yes " in lines[2]
    assert "65% of 2 threads' keystream; goal 70%: not met" in lines[2]
    assert lines[3].rstrip().endswith("no")

