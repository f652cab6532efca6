"""split_k and decompose_k: split-count heuristics, and interpreter correctness on odd shapes, layouts and
repeated calls (split_k's workspace must be clean again after every launch)."""
import dataclasses

import pytest
import torch

from backends.triton_templates import family
from kernels.core.config import interpret_mode
from kernels.space.heuristics_split_k import (
    decompose_k_splits,
    decompose_k_tile,
    k_per_split,
    split_k_choices,
)
from tests.helpers import problem
from tests.triton_helpers import assert_close, build_offered, operand

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


def test_split_k_offered_only_when_tiles_do_not_fill_the_gpu():
    pairs, why = split_k_choices(problem(m=32, n=32, k=32768))
    assert pairs and not why
    assert all(s >= 2 for _, s in pairs)
    assert split_k_choices(problem(m=4096, n=4096, k=4096))[0] == []


def test_split_k_never_leaves_a_split_empty():
    for k in (100, 1000, 3000, 4096, 32768):
        for cfg, s in split_k_choices(problem(m=16, n=16, k=k))[0]:
            kps = k_per_split(k, s, cfg.block_k)
            assert kps % cfg.block_k == 0 and (s - 1) * kps < k <= s * kps


def test_decompose_k_follows_inductors_rule():
    assert decompose_k_splits(problem(m=64, n=64, k=1024))[0] == []          # K < 32 * M
    splits, _ = decompose_k_splits(problem(m=32, n=32, k=32768))
    assert splits and all(32768 % s == 0 and 32768 // s >= 128 and s & (s - 1) == 0 for s in splits)
    assert decompose_k_splits(dataclasses.replace(problem(m=32, n=32, k=32768), dynamic=("k",)))[0] == []
    # the tile's block_k divides the part when a power of two >= 16 does, so the K loop needs no masks
    assert decompose_k_tile(problem(m=8, n=8, k=12288), 3).block_k == 128
    assert decompose_k_tile(problem(m=8, n=8, k=3000), 2).block_k == 128        # 1500: no such block


def _run(template, a, b, limit=2, calls=2):
    outcomes = build_offered(template, a, b, limit, require=True)
    for o in outcomes:
        for _ in range(calls):
            assert_close(o.runner.launch(a, b, None), a, b)
    return [o.choice.name for o in outcomes]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("m,n,k", [(1, 1, 700), (17, 33, 1000), (5, 7, 3000)])
@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "sliced")])
def test_split_k_matches_torch(dtype, m, n, k, la, lb):
    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    _run("split_k", a, b)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("m,n,k", [(5, 7, 3000), (16, 16, 2048), (3, 30, 1920)])
def test_decompose_k_matches_torch(dtype, m, n, k):
    a, b = operand(m, k, "row", dtype), operand(k, n, "col", dtype)
    names = _run("decompose_k", a, b, limit=3, calls=1)
    assert all(n.startswith("decompose_k_") and "_split" in n for n in names)


@interpreted
def test_split_k_writes_into_out_and_stays_clean():
    a, b = operand(9, 2000, "row", torch.float32), operand(2000, 12, "row", torch.float32)
    runner = build_offered("split_k", a, b, limit=1, require=True)[0].runner
    out = torch.full((18, 12), float("nan"))[::2]            # strided: goes through a staging buffer
    for _ in range(3):
        runner.launch(a, b, out)
        assert_close(out, a, b)


def test_k_offset_divisibility_is_only_assumed_when_true():
    """A split's K offset moves the operand pointers: 3008 / 16 = 188 is not a multiple of 16, so the binary must not
    assume 16-byte aligned rows of a split (on the GPU that assumption was a misaligned-address fault)."""
    p = problem(m=17, n=40, k=3008, dtype="int8", op="int_mm", stride_b=(1, 3008))
    from kernels.core.choice import Choice
    spec = family("decompose_k").specs(p, Choice("triton", "decompose_k", "int8", None, (("split", 16),)))[0]
    kps = next(a for a in spec.args if a.name == "k_per_split")
    assert not kps.div16
    spec8 = family("decompose_k").specs(p, Choice("triton", "decompose_k", "int8", None, (("split", 4),)))[0]
    assert next(a for a in spec8.args if a.name == "k_per_split").div16        # 752 = 47 * 16
