"""RowTiler: which row counts it trusts, and that it pads to them (pure torch, no model)."""

from __future__ import annotations

import torch

from steadyserve.models.layers import RowTiler


def probe(fn):
    return fn, lambda n, g: (torch.randn(n, 8, generator=g),)


def test_a_row_wise_function_keeps_every_candidate() -> None:
    tiler = RowTiler(64, enabled=True)
    assert tiler.calibrate([probe(lambda x: x * 3 + 1)]) == tiler.candidate_tiles()
    assert tiler.plan(1) == [1] and tiler.plan(63) == [64] and tiler.plan(130) == [64, 64, 2]


def test_a_function_whose_rows_depend_on_the_row_count_keeps_only_the_full_tile() -> None:
    """The calibration's teeth: rows that change with M must never be trusted below the full tile."""
    tiler = RowTiler(64, enabled=True)
    assert tiler.calibrate([probe(lambda x: x + x.shape[0])]) == [64]
    assert tiler.plan(1) == [64] and tiler.plan(65) == [64, 64]


def test_small_counts_that_differ_are_padded_to_the_first_count_that_agrees() -> None:
    """What MKL's strict mode looks like on the machines seen: M < 4 differs, M >= 4 agrees."""
    tiler = RowTiler(256, enabled=True)
    tiles = tiler.calibrate([probe(lambda x: x + (1.0 if x.shape[0] < 4 else 0.0))])
    assert tiles[0] == 4 and 256 in tiles
    assert tiler.plan(1) == [4] and tiler.plan(5) == [5] and tiler.plan(70) == [80]
    # Rows come back unpadded and equal to the full-tile computation.
    fn = lambda x: x + (1.0 if x.shape[0] < 4 else 0.0)  # noqa: E731
    x = torch.randn(3, 8)
    assert torch.equal(tiler(fn, x), x)


def test_one_failing_probe_is_enough_to_reject_a_count() -> None:
    tiler = RowTiler(32, enabled=True)
    tiles = tiler.calibrate([probe(lambda x: x * 2), probe(lambda x: x - float(x.shape[0] == 8))])
    assert 8 not in tiles and 7 in tiles and 9 in tiles
    assert tiler.plan(8) == [9]


def test_disabled_tiler_calls_the_function_once_on_all_rows() -> None:
    calls = []
    tiler = RowTiler(4, enabled=False)
    out = tiler(lambda x: calls.append(x.shape[0]) or x, torch.zeros(10, 2))
    assert calls == [10] and out.shape == (10, 2)
