"""HKVD selection contract (reference §6.5.4): count, forced rows, sorting, tie-break."""

import pytest
import torch

from kvpool.kernels.blend.select import deviation, select_rows, target_count


def test_top_scores_plus_forced_sorted() -> None:
    rows = torch.tensor([2, 3, 5, 8, 9, 11])
    scores = torch.tensor([0.1, 5.0, 0.3, 4.0, 0.2, 9.0])
    forced = torch.tensor([False, False, False, False, True, True])
    # 9 and 11 forced; the two best of the rest are 3 (5.0) and 8 (4.0)
    assert select_rows(rows, scores, forced, 2).tolist() == [3, 8, 9, 11]
    assert select_rows(rows, scores, forced, 0).tolist() == [9, 11]
    assert select_rows(rows, scores, forced, 99).tolist() == rows.tolist()


def test_ties_break_towards_the_earlier_token() -> None:
    rows = torch.arange(6)
    got = select_rows(rows, torch.zeros(6), torch.zeros(6, dtype=torch.bool), 3)
    assert got.tolist() == [0, 1, 2]
    scores = torch.tensor([1.0, 2.0, 2.0, 1.0, 2.0, 0.0])
    got = select_rows(rows, scores, torch.zeros(6, dtype=torch.bool), 2)
    assert got.tolist() == [1, 2]


def test_target_count_floors_without_float_surprises() -> None:
    assert target_count(0.15, 100) == 15  # 0.15 * 100 = 15.000000000000002 or 14.999..
    assert target_count(0.29, 100) == 29  # 0.29 * 100 = 28.999999999999996
    assert target_count(0.0, 100) == 0
    assert target_count(1.0, 7) == 7


def test_deviation_is_sum_of_squares_per_row() -> None:
    a = torch.zeros(3, 2, 4)
    b = torch.zeros(3, 2, 4)
    b[1, 0, 0], b[2] = 3.0, 1.0
    assert deviation(a, b).tolist() == [0.0, 9.0, 8.0]
    assert deviation(a.to(torch.bfloat16), b.to(torch.bfloat16)).dtype == torch.float32


def test_bad_arguments_are_rejected() -> None:
    rows = torch.arange(3)
    with pytest.raises(ValueError, match="equal-length"):
        select_rows(rows, torch.zeros(2), torch.zeros(3, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="count"):
        select_rows(rows, torch.zeros(3), torch.zeros(3, dtype=torch.bool), -1)
