"""bench/ddp.py's pure logic: the per-rank micro-batch, steady-state tokens/s, the loss check and
its command line. No training runs here (the script itself runs torchrun for minutes)."""

from pathlib import Path

import pytest

from tests.fixtures import bench_script


@pytest.fixture(scope="module")
def ddp():
    return bench_script("ddp", "bench_ddp_test")


def test_demo_batch_splits_into_four_sequences_per_rank(ddp) -> None:
    # demo.toml: 2,048 tokens = 8 sequences of 256 in one micro-batch of 8; over 2 ranks, 4 each.
    assert ddp.rank_micro_batch(2048, 256, 8, 2) == 4
    assert ddp.rank_micro_batch(2048, 256, 8, 1) == 8  # one process keeps the recipe's
    assert ddp.rank_micro_batch(4096, 256, 8, 2) == 8  # it fits: unchanged (2 ranks × 8)
    assert ddp.rank_micro_batch(4096, 256, 3, 2) == 2  # the largest divisor of 8 below 3
    assert ddp.rank_micro_batch(1536, 256, 8, 2) == 3


def test_a_batch_that_cannot_split_says_why_in_one_line(ddp) -> None:
    with pytest.raises(SystemExit) as exc:
        ddp.rank_micro_batch(1792, 256, 8, 2)  # 7 sequences over 2 ranks
    message = str(exc.value)
    assert "7 sequences" in message and "2 ranks" in message and "512" in message
    assert "\n" not in message
    with pytest.raises(SystemExit, match=r"data\.seq_len"):
        ddp.rank_micro_batch(2000, 256, 8, 2)


def test_tokens_per_second_leaves_out_the_warmup_steps(ddp) -> None:
    seconds = [5.0, 3.0, 0.5, 0.25, 0.25]  # slow first steps, then 1 s for 3 steps
    assert ddp.steady_tokens_per_s(seconds, 2048, warmup=2) == pytest.approx(3 * 2048 / 1.0)
    assert ddp.steady_tokens_per_s(seconds, 2048, warmup=0) == pytest.approx(5 * 2048 / 9.0)
    with pytest.raises(ValueError, match="no steady-state steps"):
        ddp.steady_tokens_per_s(seconds, 2048, warmup=5)
    with pytest.raises(ValueError):
        ddp.steady_tokens_per_s([1.0, 0.0], 2048, warmup=1)


def test_loss_gaps_and_the_tolerances(ddp) -> None:
    assert ddp.tail_mean([9.0, 4.0, 2.0], 2) == pytest.approx(3.0)
    assert ddp.tail_mean([4.0], 10) == pytest.approx(4.0)  # fewer steps than the tail
    with pytest.raises(ValueError):
        ddp.tail_mean([], 10)
    a = {"tail_train_loss": 3.8485, "holdout_loss": 3.70, "final_train_loss": 3.0}
    b = {"tail_train_loss": 3.8437, "holdout_loss": 3.75, "final_train_loss": 3.2}
    gaps = ddp.loss_gaps(a, b)
    assert set(gaps) == {"tail_train_loss", "holdout_loss"}  # the last step alone is not checked
    assert gaps["tail_train_loss"] == pytest.approx(0.0048)
    assert gaps["holdout_loss"] == pytest.approx(0.05)
    assert not ddp.losses_agree(gaps)  # the holdout gap is over its 0.02
    assert ddp.losses_agree({"tail_train_loss": 0.0066, "holdout_loss": 0.0039})  # step 50's
    assert not ddp.losses_agree({"tail_train_loss": 0.04, "holdout_loss": 0.0})


def test_arguments_defaults_tiny_and_refusals(ddp, capsys) -> None:
    args = ddp.parse_args([])
    assert (args.steps, args.warmup, args.threads, args.procs) == (200, 10, 2, 2)
    tiny = ddp.parse_args(["--tiny"])
    assert (tiny.steps, tiny.warmup) == (ddp.TINY_STEPS, ddp.TINY_WARMUP)
    assert ddp.parse_args(["--steps", "50", "--noisy"]).steps == 50
    for bad, said in (
        (["--steps", "10"], "must be more than --warmup"),
        (["--steps", "5", "--warmup", "-1"], "must be more than --warmup"),
        (["--procs", "1"], "--procs must be >= 2"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--set", "optim.lr"], "expected KEY=VALUE"),
    ):
        with pytest.raises(SystemExit):
            ddp.parse_args(bad)
        assert said in capsys.readouterr().err


def test_both_runs_get_the_same_recipe_but_the_micro_batch(ddp, tmp_path: Path) -> None:
    spec = {"data": str(tmp_path), "steps": 7, "set": ddp.TINY_SET}
    one, ranks = ddp.run_config(spec, None), ddp.run_config(spec, 4)
    assert one.train.max_steps == ranks.train.max_steps == 7
    assert one.batch.global_tokens == ranks.batch.global_tokens == 2048
    assert (one.batch.micro_batch, ranks.batch.micro_batch) == (8, 4)
    assert one.model["n_layer"] == 1 and one.train.seed == ranks.train.seed
