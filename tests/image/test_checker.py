"""The checker's targets, its scoring of pictures against captions, and the Fréchet distance."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kiln.image.checker import (
    COLOUR_NAMES,
    KIND_NAMES,
    Checker,
    CheckerConfig,
    checker_loss,
    frechet_distance,
    predict,
    score,
    targets,
)  # fmt: skip
from kiln.image.render import render
from kiln.image.scenes import sample_scene


def _records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        rng = random.Random(f"t:{i}")
        scene = sample_scene(rng, unseen=False)
        out.append({"caption": scene.caption(), **render(scene, 32, rng)[1]})
    return out


def _perfect(records: list[dict]) -> dict[str, torch.Tensor]:
    """Outputs that say exactly the ground truth (logits ±10, one-hot colours, true centres)."""
    truth = targets(records)
    colour = torch.full((len(records), len(KIND_NAMES), len(COLOUR_NAMES)), -10.0)
    known = truth["colour"] >= 0
    colour[known, truth["colour"][known]] = 10.0
    return {"present": truth["present"] * 20 - 10, "colour": colour, "centre": truth["centre"]}


def test_ground_truth_scores_perfectly_and_mistakes_count_per_attribute() -> None:
    records = _records(200)
    out = _perfect(records)
    assert score(out, records) == {"object": 1.0, "colour": 1.0, "relation": 1.0, "all": 1.0}
    mirrored = {**out, "centre": 1 - out["centre"]}  # left <-> right and above <-> under
    bad = score(mirrored, records)
    assert bad["relation"] == 0.0 and bad["object"] == 1.0 and bad["colour"] == 1.0
    wrong_colour = {**out, "colour": out["colour"].roll(1, dims=-1)}
    assert score(wrong_colour, records)["colour"] == 0.0
    nothing = {**out, "present": -out["present"]}
    assert score(nothing, records)["object"] == 0.0


def test_targets_hold_kinds_colours_and_centres() -> None:
    records = _records(30)
    truth = targets(records)
    for i, r in enumerate(records):
        kinds = {o["kind"] for o in r["objects"]}
        assert {KIND_NAMES[k] for k in truth["present"][i].nonzero().flatten().tolist()} == kinds
        assert truth["centre"][i].max() <= 1 and truth["centre"][i].min() >= 0


def test_frechet_distance_is_zero_on_itself_and_the_mean_shift_squared() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, 6, generator=g)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    shift = torch.tensor([1.0, 2.0, 0, 0, 0, 0])
    assert frechet_distance(a, a + shift) == pytest.approx(5.0, rel=1e-6)
    # Against scipy's sqrtm formula on anisotropic Gaussians.
    scipy_linalg = pytest.importorskip("scipy.linalg")
    b = torch.randn(4000, 6, generator=g) @ torch.randn(6, 6, generator=g)
    x, y = a.double().numpy(), b.double().numpy()
    cx, cy = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    root = scipy_linalg.sqrtm(cx @ cy).real
    want = ((x.mean(0) - y.mean(0)) ** 2).sum() + np.trace(cx + cy - 2 * root)
    assert frechet_distance(a, b) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("head", ["spatial", "flat"])
@pytest.mark.parametrize("size", [32, 64])
def test_the_checker_reads_either_size(size: int, head: str) -> None:
    checker = Checker(CheckerConfig(image_size=size, channels=8, features=16, head=head))
    out = checker(torch.zeros(2, 3, size, size))
    assert out["present"].shape == (2, 29) and out["colour"].shape == (2, 29, 11)
    assert out["centre"].shape == (2, 29, 2) and out["features"].shape == (2, 16)
    assert torch.equal(checker.features(torch.zeros(2, 3, size, size)), out["features"])


def test_the_checker_learns_its_training_renders() -> None:
    """A small spatial checker fits 96 renders far above chance (k/29 for objects)."""
    torch.manual_seed(0)
    rng = random.Random("learn")
    records, pictures = [], []
    for _ in range(96):
        scene = sample_scene(rng, unseen=False)
        image, truth = render(scene, 32, rng)
        records.append({"caption": scene.caption(), **truth})
        pictures.append(np.asarray(image, dtype=np.float32) / 127.5 - 1)
    x = torch.from_numpy(np.stack(pictures)).permute(0, 3, 1, 2).contiguous()
    truth = targets(records)
    cfg = CheckerConfig(channels=16, features=64)
    checker = Checker(cfg)
    before = score(predict(checker, x), records)
    optimizer = torch.optim.AdamW(checker.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(150):
        idx = torch.randint(0, len(x), (32,))
        loss = checker_loss(checker.train()(x[idx]), {k: v[idx] for k, v in truth.items()}, cfg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = score(predict(checker, x), records)
    assert before["object"] < 0.3
    assert after["object"] > 0.8 and after["colour"] > 0.6 and after["relation"] > 0.8, after
