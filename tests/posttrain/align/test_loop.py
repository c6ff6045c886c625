"""The settings DPO, reward-model and RL training share: one set of checks, each error naming its
loop's section and field, the TOML keys and `--set` flags as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import config as cfgio
from kiln.cli import main
from kiln.config import ConfigError
from kiln.posttrain.align import loop as loop_module
from kiln.posttrain.align.dpo import DPOConfig
from kiln.posttrain.align.loop import LoopConfig, PosttrainLoop, PosttrainRun
from kiln.posttrain.align.reward_model import RewardConfig
from kiln.posttrain.align.rl import RLConfig
from kiln.posttrain.align.run import RUN_CONFIGS

CONFIGS = [(DPOConfig, "dpo"), (RewardConfig, "reward"), (RLConfig, "rl")]
SHARED_BAD = [("steps", 0, "must be >= 1"), ("save_every", 0, "must be >= 1"),
              ("keep_last", 0, "must be >= 1"), ("lr", 0.0, "must be > 0"),
              ("weight_decay", -0.1, "must be >= 0"), ("grad_clip", 0.0, "must be > 0")]  # fmt: skip


@pytest.mark.parametrize(("cls", "section"), CONFIGS)
@pytest.mark.parametrize(("field", "value", "expected"), SHARED_BAD)
def test_a_bad_shared_setting_names_the_loops_section_and_field(
    cls: type[LoopConfig], section: str, field: str, value: object, expected: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.{field} {expected}, got {value}$"):
        cls(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "field"),
    [(DPOConfig, "pairs_per_step"), (DPOConfig, "eval_every"), (RewardConfig, "pairs_per_step"),
     (RewardConfig, "eval_every"), (RLConfig, "prompts_per_step"), (RLConfig, "epochs"),
     (RLConfig, "max_new_tokens")],
)  # fmt: skip
def test_each_loops_own_counts_must_be_at_least_one(cls: type[LoopConfig], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{cls.SECTION}\.{field} must be >= 1, got 0$"):
        cls(**{field: 0})  # type: ignore[arg-type]


def test_every_loop_has_the_shared_settings_with_its_own_defaults() -> None:
    shared = {"steps", "lr", "weight_decay", "grad_clip", "seed", "save_every", "keep_last"}
    for cls, section in CONFIGS:
        assert issubclass(cls, LoopConfig) and section == cls.SECTION
        assert shared <= set(cfgio.to_dict(cls()))
    assert (DPOConfig().steps, RewardConfig().steps, RLConfig().steps) == (100, 200, 20)
    assert (DPOConfig().lr, RewardConfig().lr, RLConfig().lr) == (5e-6, 1e-4, 1e-5)


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_shipped_configs_load_and_a_set_flag_reaches_the_shared_fields(kind: str) -> None:
    path = Path(__file__).resolve().parents[3] / "configs" / f"{kind}.toml"
    cfg = cfgio.load(RUN_CONFIGS[kind], str(path), [f"{kind}.keep_last=5", f"{kind}.seed=3"])
    assert (getattr(cfg, kind).keep_last, getattr(cfg, kind).seed) == (5, 3)
    with pytest.raises(ConfigError, match=f"{kind}.stepz"):
        cfgio.load(RUN_CONFIGS[kind], str(path), [f"{kind}.stepz=1"])


def test_the_command_refuses_a_bad_shared_setting_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["rl", "--set", f"run_dir={tmp_path / 'run'}", "--set", "policy.base=x",
            "--set", "data.chat=y", "--set", "rl.save_every=0", "--no-progress"]  # fmt: skip
    assert main(args) == 2
    assert "rl.save_every must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


class _TenSecondSteps(PosttrainLoop):
    """A loop whose every update takes ten seconds of a fake clock."""

    section = "loop"

    def __init__(self, cfg: LoopConfig, out: Path, clock: list[float]) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.cfg, self.run_dir, self.clock = cfg, PosttrainRun(out, None, cfg.keep_last), clock

    def train_step(self) -> dict[str, int]:
        self.step += 1
        self.clock[0] += 10.0
        return {"step": self.step}


def test_a_time_budget_stops_the_loop_and_a_resumed_run_counts_what_was_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [0.0]
    monkeypatch.setattr(loop_module.time, "perf_counter", lambda: clock[0])
    cfg = LoopConfig(steps=100, save_every=50, time_budget="25s")
    first = _TenSecondSteps(cfg, tmp_path, clock)
    first.run()
    assert (first.step, first.out_of_time) == (3, True)  # 30 s >= 25 s after the third update
    assert (tmp_path / "checkpoints" / "step_3").is_dir()  # saved where it stopped
    again = _TenSecondSteps(cfg, tmp_path, clock)
    assert again.resume() and again.seconds == 30.0
    again.run()
    assert (again.step, again.out_of_time) == (3, True)  # the budget was spent: no more updates
    longer = _TenSecondSteps(
        LoopConfig(steps=100, save_every=50, time_budget="1m"), tmp_path, clock
    )
    longer.resume()
    longer.run()
    assert longer.step == 6


def test_a_bad_time_budget_names_the_loops_field() -> None:
    with pytest.raises(ConfigError, match=r"rl\.time_budget"):
        RLConfig(time_budget="soon")
