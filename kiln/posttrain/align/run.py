"""`kiln dpo`, `kiln reward` and `kiln rl`: run configs, and the run folder each trains into.

A run starts from a chat model (`policy.base`, an SFT run in the usual chain) and writes a kiln
run folder: `config.toml` (resolved), `tokenizer.json` (the base's, so the run loads on its own),
`metrics.jsonl`, `checkpoints/step_N/` (the policy as `model.safetensors`, loadable by every
command through kiln.loading) and `report/` (a PNG of the logged curves).
"""

from __future__ import annotations

import json
import random
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln import config as cfgio
from kiln.chat import render, require_chat_template
from kiln.checkpoint_format import config_differences, latest_checkpoint, read_state
from kiln.config import require
from kiln.errors import KilnError
from kiln.folders import remove_dir
from kiln.io import atomic_write, sha256_file, write_json_atomic
from kiln.loading import LoadedModel, find_checkpoint, load_model
from kiln.posttrain.align.dpo import DPOConfig, TokenPair
from kiln.posttrain.align.preferences import read_pairs, tokenize_pair
from kiln.posttrain.align.reward_model import RewardConfig, load_reward_model, score_sequences
from kiln.posttrain.align.rl import RLConfig
from kiln.posttrain.chat_data import read_manifest, split_file
from kiln.posttrain.tasks import score


@dataclass(frozen=True)
class PolicySection:
    """The model to start from and the frozen reference (default: the same model)."""

    base: str = ""
    reference: str = ""
    device: str = "cpu"

    def __post_init__(self) -> None:
        """A run needs a base model."""
        require(bool(self.base), "policy.base: set the model to start from (e.g. an SFT run)")


@dataclass(frozen=True)
class PairsSection:
    """Preference pairs (`kiln posttrain preferences` output) and the held-out share."""

    pairs: str = ""
    heldout: float = 0.1
    seed: int = 0
    chat: str = ""  # online DPO (dpo.resample_every > 0): the `kiln data chat` folder it samples

    def __post_init__(self) -> None:
        """Pairs are required; the held-out share is a fraction."""
        require(bool(self.pairs), "data.pairs: set the preference pairs file (JSON lines)")
        require(0 <= self.heldout < 1, f"data.heldout must be in [0, 1), got {self.heldout}")


@dataclass(frozen=True)
class PromptsSection:
    """RL prompts: a `kiln data chat` folder's train split, rewarded by its task checks
    (times task_weight) plus an optional learned reward model (times reward_model_weight)."""

    chat: str = ""
    max_prompts: int = 0  # 0: every train prompt
    task_weight: float = 1.0
    reward_model: str = ""
    reward_model_weight: float = 0.0

    def __post_init__(self) -> None:
        """Prompts are required and some reward must count."""
        require(bool(self.chat), "data.chat: set the `kiln data chat` folder with the prompts")
        require(self.max_prompts >= 0, f"data.max_prompts must be >= 0, got {self.max_prompts}")
        require(
            self.task_weight > 0 or (self.reward_model and self.reward_model_weight > 0),
            "data: no reward counts (task_weight is 0 and no weighted reward_model)",
        )


@dataclass(frozen=True)
class DPORunConfig:
    """`kiln dpo CONFIG.toml`."""

    policy: PolicySection = field(default_factory=PolicySection)
    data: PairsSection = field(default_factory=PairsSection)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    run_dir: str = "runs/dpo"


@dataclass(frozen=True)
class RewardRunConfig:
    """`kiln reward CONFIG.toml` (policy.base is the LM body the reward model starts from)."""

    policy: PolicySection = field(default_factory=PolicySection)
    data: PairsSection = field(default_factory=PairsSection)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run_dir: str = "runs/reward"


@dataclass(frozen=True)
class RLRunConfig:
    """`kiln rl CONFIG.toml` (rl.algorithm: grpo or ppo)."""

    policy: PolicySection = field(default_factory=PolicySection)
    data: PromptsSection = field(default_factory=PromptsSection)
    rl: RLConfig = field(default_factory=RLConfig)
    run_dir: str = "runs/rl"


# ---- the run folder ---------------------------------------------------------------------------


MARKER = "posttrain_run.json"  # written first into every run folder these commands own


def prepare_run_dir(run_dir: Path, cfg: Any, resume: bool, force: bool) -> None:
    """Refuse to train over an earlier run unless resuming (or --force: start over).

    Only a folder these commands made (it holds MARKER) is ever written into or replaced: a
    user's other folder (an SFT run, a config directory) is refused even under --force.
    """
    owned = (run_dir / MARKER).is_file()
    if run_dir.exists() and any(run_dir.iterdir()) and not owned:
        raise KilnError(
            f"{run_dir}: exists and is not a run folder of kiln dpo/reward/rl (no {MARKER}); "
            "choose another run_dir"
        )
    has_run = latest_checkpoint(run_dir / "checkpoints") is not None
    if has_run and not resume and not force:
        raise KilnError(
            f"{run_dir}: holds a run already; --resume to continue it, --force to start over"
        )
    if has_run and force and not resume:
        remove_dir(run_dir)
    data = data_fingerprint(cfg)
    if has_run and resume:
        check_resumable(run_dir, cfg, data)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        run_dir / MARKER, {"format": "kiln.posttrain_run", "version": 1, "data": data}
    )
    with atomic_write(run_dir / "config.toml") as handle:
        handle.write(cfgio.to_toml(cfgio.to_dict(cfg)))


# What a resumed run may change: how long it trains and how often it saves, evaluates, keeps.
RESUMABLE = frozenset({"steps", "save_every", "eval_every", "keep_last"})


def data_fingerprint(cfg: Any) -> dict[str, str]:
    """sha256 of the data file a run trains on (its pairs, or its chat folder's train prompts)."""
    data = cfg.data
    if isinstance(data, PromptsSection):  # split_file checked the file against this sha256
        path = split_file(data.chat, "train")
        return {"file": str(path), "sha256": read_manifest(data.chat)["splits"]["train"]["sha256"]}
    path = Path(data.pairs)
    if not path.is_file():
        raise KilnError(f"{path}: no such file (data.pairs: the preference pairs, JSON lines)")
    return {"file": str(path), "sha256": sha256_file(path)}


def check_resumable(run_dir: Path, cfg: Any, data: dict[str, str]) -> None:
    """Refuse to resume a run whose settings or data changed, beyond its length and cadence."""
    saved_path = run_dir / "config.toml"
    try:
        saved = tomllib.loads(saved_path.read_text())
        marker = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(f"{run_dir}: cannot read its config.toml or {MARKER}: {exc}") from None
    # The data is identified by its contents (below), so data that moved may still resume.
    changed = [
        d for d in config_differences(saved, cfgio.to_dict(cfg))
        if d.split(":", 1)[0] not in ("data.pairs", "data.chat")
        and d.split(":", 1)[0].rsplit(".", 1)[-1] not in RESUMABLE
    ]  # fmt: skip
    if marker.get("data", {}).get("sha256") not in (None, data["sha256"]):
        changed.append(f"data: {data['file']} differs from the file the run trained on (sha256)")
    if changed:
        raise KilnError(
            f"cannot resume {run_dir}: its settings or data changed ({'; '.join(changed)}); "
            "restore them, or start a new run (another run_dir, or --force to start over)"
        )


def load_policy(section: PolicySection, run_dir: Path) -> tuple[LoadedModel, dict[str, Any]]:
    """The base model (fp32, train-ready) and the state its checkpoints inherit.

    The base's tokenizer is copied into the run folder and recorded by sha256, so the run's
    checkpoints load with it wherever the base's data went.
    """
    loaded = load_model(section.base, device=section.device, dtype="fp32")
    if loaded.tokenizer is None or loaded.tokenizer_path is None:
        raise KilnError(f"{section.base}: no tokenizer found (post-training renders chats)")
    require_chat_template(loaded.tokenizer, section.base)
    with atomic_write(run_dir / "tokenizer.json", "wb", encoding=None) as handle:
        handle.write(loaded.tokenizer_path.read_bytes())
    config: dict[str, Any] = {}
    try:
        base_config = read_state(find_checkpoint(section.base)).get("config", {})
        config = {k: v for k, v in base_config.items() if k not in ("lora", "data", "sft")}
    except KilnError:
        pass  # an HF folder: the model config is recorded from the model itself
    state = {
        "config": config,
        "dataset": {"tokenizer_sha256": sha256_file(run_dir / "tokenizer.json")},
    }
    return loaded, state


def load_reference(section: PolicySection) -> Any:
    """The frozen reference model, or None to copy the base."""
    if not section.reference:
        return None
    return load_model(section.reference, device=section.device, dtype="fp32").model


def split_pairs(
    pairs: Sequence[TokenPair], heldout: float, seed: int
) -> tuple[list[TokenPair], list[TokenPair]]:
    """Train and held-out pairs (a seeded shuffle; at least one train pair)."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    n_held = min(len(pairs) - 1, round(len(pairs) * heldout))
    return [pairs[i] for i in order[n_held:]], [pairs[i] for i in order[:n_held]]


def token_pairs(path: str, tokenizer: Any, block_size: int) -> list[TokenPair]:
    """The pairs of a preferences file that fit the model's context, as token ids.

    A bad pair is an error naming its line; pairs too long for the context are dropped and
    counted in one warning (a story task can outgrow a small model's block size).
    """
    pairs = [tokenize_pair(p, tokenizer, f"{path}: pair {n}")
             for n, p in enumerate(read_pairs(path), start=1)]  # fmt: skip
    fits = [p for p in pairs if len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= block_size]
    if len(fits) < len(pairs):
        print(f"warning: {path}: {len(pairs) - len(fits)} of {len(pairs)} pairs are longer than "
              f"the model's {block_size}-token context; left out", file=sys.stderr)  # fmt: skip
    if not fits:
        raise KilnError(f"{path}: no pair fits the model's {block_size}-token context")
    return fits


# ---- RL prompts and rewards -------------------------------------------------------------------

MIN_REPLY_ROOM = 32  # tokens a prompt must leave for its reply (kiln eval --chat-tasks' rule)


def rl_prompts(
    section: PromptsSection, loaded: LoadedModel, max_new_tokens: int
) -> tuple[list[list[int]], Callable[[int, list[int]], float]]:
    """The prompts (rendered, generation prompt added) and the reward of a reply to prompt i."""
    from kiln.chat import iter_conversations

    tok = loaded.tokenizer
    assert tok is not None
    records = list(iter_conversations(split_file(section.chat, "train")))
    prompts = [render(r["messages"][:-1], tok, add_generation_prompt=True).ids for r in records]
    # A prompt's reply may use the context it leaves (rollout.sample_responses), so only prompts
    # that leave less than MIN_REPLY_ROOM (or max_new_tokens, when smaller) are left out.
    need = min(max_new_tokens, MIN_REPLY_ROOM)
    block = loaded.model.cfg.block_size
    kept = [i for i, p in enumerate(prompts) if block - len(p) >= need]
    if len(kept) < len(prompts):
        print(f"warning: {section.chat}: {len(prompts) - len(kept)} of {len(prompts)} prompts "
              f"leave fewer than {need} tokens for a reply in the model's {block}-token "
              "context; left out", file=sys.stderr)  # fmt: skip
    kept = kept[: section.max_prompts] if section.max_prompts else kept
    if not kept:
        raise KilnError(f"{section.chat}: no prompt fits the model's context")
    records, prompts = [records[i] for i in kept], [prompts[i] for i in kept]
    special = set(tok.special_tokens.values())
    rm = load_reward_model(find_checkpoint(section.reward_model)) if section.reward_model else None

    def reward(i: int, reply: list[int]) -> float:
        body = [t for t in reply if t not in special]
        total = section.task_weight * score(records[i], tok.decode(body))
        if rm is not None and section.reward_model_weight:
            import torch

            with torch.no_grad():
                total += section.reward_model_weight * float(
                    score_sequences(rm, [prompts[i] + reply])[0]
                )
        return total

    return prompts, reward


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar over steps (rate and ETA), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def bar_callback(bar: Any, keys: Sequence[str]) -> Callable[[dict[str, Any]], None]:
    """A progress callback that advances the bar and shows some metrics."""

    def update(record: dict[str, Any]) -> None:
        if bar is None:
            return
        bar.update(1)
        bar.set_postfix({k: f"{record[k]:.3g}" for k in keys if k in record})

    return update


# ---- running a config ---------------------------------------------------------------------------

RUN_CONFIGS: dict[str, type] = {"dpo": DPORunConfig, "reward": RewardRunConfig, "rl": RLRunConfig}
SHOWN = {
    "dpo": ("loss", "accuracy"),
    "reward": ("loss", "accuracy"),
    "rl": ("reward_mean", "finished", "kl", "clip_fraction"),
}


def run_from_config(
    kind: str,
    config_path: str | None,
    overrides: Sequence[str],
    resume: bool,
    force: bool,
    progress: bool = True,
) -> str:
    """Train one `kiln dpo|reward|rl` run from its config; returns the summary line."""
    from kiln.posttrain.align.dpo import DPOTrainer
    from kiln.posttrain.align.report import CURVES, plot_curves
    from kiln.posttrain.align.reward_model import RewardModel, RewardTrainer
    from kiln.posttrain.align.rl import RLTrainer

    cfg = cfgio.load(RUN_CONFIGS[kind], config_path, overrides)
    if kind == "rl" and cfg.rl.value_init == "reward" and not cfg.data.reward_model:
        raise KilnError("rl.value_init = reward: set data.reward_model (the critic starts from it)")
    if kind == "dpo" and cfg.dpo.resample_every and not cfg.data.chat:
        raise KilnError("dpo.resample_every > 0 (online DPO): set data.chat (its prompts)")
    run_dir = Path(cfg.run_dir)
    prepare_run_dir(run_dir, cfg, resume, force)
    loaded, base_state = load_policy(cfg.policy, run_dir)
    tok = loaded.tokenizer
    policy = loaded.model.train().requires_grad_(True)
    for module in policy.modules():  # no dropout: the old, reference and new log-probs must agree
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    settings = getattr(cfg, kind)
    bar = progress_bar(settings.steps, 0, f"kiln {kind}", progress)
    show = bar_callback(bar, SHOWN[kind])
    trainer: Any
    if kind == "rl":
        prompts, reward = rl_prompts(cfg.data, loaded, settings.max_new_tokens)
        value_from = None
        if settings.algorithm == "ppo" and settings.value_init == "reward":
            value_from = load_reward_model(find_checkpoint(cfg.data.reward_model))
        trainer = RLTrainer(
            policy, prompts, reward, settings, run_dir, eot_id=require_chat_template(tok, "rl").end_id,
            reference=load_reference(cfg.policy), value_from=value_from, base_state=base_state,
            progress=show,
        )  # fmt: skip
    else:
        pairs = token_pairs(cfg.data.pairs, tok, policy.cfg.block_size)
        train, held = split_pairs(pairs, cfg.data.heldout, cfg.data.seed)
        if kind == "dpo" and settings.resample_every:
            from kiln.chat import iter_conversations
            from kiln.posttrain.align.online_dpo import OnlineDPOTrainer

            trainer = OnlineDPOTrainer(
                policy, train, settings, run_dir, held_out=held,
                reference=load_reference(cfg.policy), base_state=base_state, progress=show,
                records=list(iter_conversations(split_file(cfg.data.chat, "train"))),
                tokenizer=tok,
            )  # fmt: skip
        elif kind == "dpo":
            trainer = DPOTrainer(
                policy, train, settings, run_dir, held_out=held,
                reference=load_reference(cfg.policy), base_state=base_state, progress=show,
            )  # fmt: skip
        else:
            full = [(p.prompt + p.chosen, p.prompt + p.rejected) for p in train]
            full_held = [(p.prompt + p.chosen, p.prompt + p.rejected) for p in held]
            trainer = RewardTrainer(
                RewardModel(policy), full, settings, run_dir, held_out=full_held,
                base_state=base_state, progress=show,
            )  # fmt: skip
    resumed = resume and trainer.resume()
    if bar is not None:
        bar.update(trainer.step)
    trainer.run()
    if bar is not None:
        bar.close()
    records = trainer.metrics.read()
    picture = plot_curves(records, CURVES[kind], run_dir / "report" / f"{kind}.png")
    last = records[-1] if records else {}
    shown = ", ".join(f"{k} {last[k]:.4g}" for k in (*SHOWN[kind], "val_accuracy") if k in last)
    return (
        f"kiln {kind}: {'resumed, ' if resumed else ''}{trainer.step:,} steps"
        f"{' (its time budget ran out)' if trainer.out_of_time else ''} in {run_dir}"
        f" ({shown}){f'; curves in {picture}' if picture else ''}"
    )
