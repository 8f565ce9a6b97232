"""hybridtrain.wiresize counts the bytes trainer.frames.pack really produces: exactly where the
encoding does not depend on where the kept elements lie, within 2% for the delta encodings."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridtrain import wiresize
from hybridtrain.contract import VALUE_BYTES
from trainer.compression import Payload, random_indices
from trainer.frames import Buffers, Grad, SiteGrad, SiteMean, Update, pack
from trainer.site_replica import PIECE as SITE_PIECE
from trainer.site_replica import pieces as site_pieces
from trainer.site_replica import site_dtype
from trainer.wire import _encoding

WIRE = 8  # the transport's length prefix


VALUE_DTYPES = {4: torch.float32, 2: torch.float16, 1: torch.float8_e4m3fn}


def _sparse(numel: int, kept: int | None, vbytes: int, seed: int, *, seeded: bool = False) -> Payload:
    gen = torch.Generator().manual_seed(seed)
    if kept is None:
        return Payload(numel, torch.randn(numel, generator=gen))
    values = torch.randn(kept, generator=gen).to(VALUE_DTYPES[vbytes])
    if seeded:
        return Payload(numel, values, random_indices(numel, kept, seed), seed)
    indices = torch.randperm(numel, generator=gen)[:kept].sort().values
    return Payload(numel, values, indices)


def _cases(count: int) -> list[tuple[int, int, int | None, int]]:
    rng = random.Random(16)
    cases = []
    for _ in range(count):
        numel = rng.choice([1, 7, 100, 4096, 70_000, 300_000, 1_500_000])
        dense = rng.choice([0, 10, 1024, 5000])
        density = rng.choice([None, 0.0005, 0.002, 0.01, 0.03, 1 / 32, 0.05, 0.125, 0.4])
        kept = None if density is None else wiresize.kept_for(numel, density)
        cases.append((dense, numel, kept, rng.choice([2, 2, 4, 1])))
    return cases


@pytest.mark.parametrize(("dense", "numel", "kept", "vbytes"), _cases(40))
def test_grad_frame_bytes_match_packed_frame(dense, numel, kept, vbytes):
    sparse = _sparse(numel, kept, vbytes, seed=numel + dense)
    frame = Grad(3, 1, 0, 0.5, 32, 0.1, 0.2, 0.01, Payload(dense, torch.randn(dense)), sparse)
    real = pack(frame).numel() + WIRE
    predicted = wiresize.grad_frame_bytes(dense, numel, kept, vbytes)
    if kept is None or _encoding(sparse)[0] not in (3, 4):
        assert predicted == real
    else:
        assert predicted == pytest.approx(real, rel=0.02)


@pytest.mark.parametrize(("dense", "numel", "kept", "vbytes"), _cases(30))
def test_update_frame_bytes_match_packed_last_chunk(dense, numel, kept, vbytes):
    sparse = _sparse(numel, kept, vbytes, seed=7 * numel + dense)
    workers = 1 + numel % 5
    frame = Update(3, 0, Payload(dense, torch.randn(dense)), sparse, 0.25, tuple([0.01] * workers),
                   tuple([16] * workers))
    real = pack(frame).numel() + WIRE
    predicted = wiresize.update_frame_bytes(dense, numel, kept, vbytes, workers=workers)
    if kept is None or _encoding(sparse)[0] not in (3, 4):
        assert predicted == real
    else:
        assert predicted == pytest.approx(real, rel=0.02)


def test_update_frame_bytes_of_a_middle_chunk_carry_no_plan():
    sparse = _sparse(50_000, 500, 2, seed=1)
    frame = Update(4, 0, Payload(0, torch.zeros(0)), sparse)
    predicted = wiresize.update_frame_bytes(0, 50_000, 500, 2, workers=0)
    assert predicted == pytest.approx(pack(frame).numel() + WIRE, rel=0.02)


def test_seeded_payload_counts_one_seed_instead_of_indices():
    sparse = _sparse(100_000, 1000, 2, seed=5, seeded=True)
    frame = Grad(9, 2, 0, 0.5, 32, 0.1, 0.2, 0.01, Payload(0, torch.zeros(0)), sparse)
    assert wiresize.grad_frame_bytes(0, 100_000, 1000, 2, seeded=True) == pack(frame).numel() + WIRE


def test_buffers_frame_bytes_match_packed_frame():
    frame = Buffers(50, 1, 32, torch.randn(1234))
    assert wiresize.buffers_frame_bytes(1234) == pack(frame).numel() + WIRE


def test_expected_fillers_match_a_monte_carlo_mean():
    numel, kept, rng = 200_000, 300, random.Random(0)
    draws = []
    for _ in range(200):
        idx = sorted(rng.sample(range(numel), kept))
        gaps = [b - a for a, b in zip([-1, *idx[:-1]], idx)]
        draws.append(sum((g - 1) // 255 for g in gaps))
    mean = sum(draws) / len(draws)
    assert wiresize.expected_fillers(numel, kept, 255) == pytest.approx(mean, rel=0.03)


def test_expected_fillers_are_zero_when_no_gap_can_exceed_the_limit():
    assert wiresize.expected_fillers(200, 10, 255) == 0.0
    assert math.isclose(wiresize.expected_fillers(10_000, 10_000, 255), 0.0, abs_tol=1e-9)


@pytest.mark.parametrize("numel", [1, 5000, SITE_PIECE, SITE_PIECE + 1, 3 * SITE_PIECE - 7])
@pytest.mark.parametrize("value_dtype", ["fp16", "fp32"])
def test_site_frames_bytes_match_a_members_pieces_and_the_relays_means(numel, value_dtype):
    flat = torch.randn(numel).to(site_dtype(value_dtype))
    parts = [flat[a:b] for a, b in site_pieces(numel)]
    grads = sum(pack(SiteGrad(4, 2, p, 32, part)).numel() + WIRE for p, part in enumerate(parts))
    means = sum(pack(SiteMean(4, 1, p, part)).numel() + WIRE for p, part in enumerate(parts))
    width = wiresize.site_value_bytes(VALUE_BYTES[value_dtype])
    assert (wiresize.site_grad_bytes(numel, width), wiresize.site_mean_bytes(numel, width)) == (grads, means)
