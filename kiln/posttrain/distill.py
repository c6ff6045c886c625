"""Knowledge distillation: `kiln distill CONFIG.toml` trains a student on a teacher's logits.

A distillation run is a pre-training run (`DistillConfig` is a `TrainConfig`: the same data,
model, optim, schedule, batch, train, eval, checkpoint and logging sections, on the same
`Trainer`) whose loss per micro-batch is

    loss = kl_weight · τ² · KL(teacher_τ ‖ student_τ) + ce_weight · CE(student, next token)

(`distill.loss = "reverse_kl"` swaps the KL's arguments). The teacher is any folder
`kiln.loading` reads and must use the dataset's tokenizer; it runs frozen, in eval mode, beside
the student in every micro-step. The student starts from the config's [model] (fresh weights) or,
with `distill.student`, from another model folder's weights and config: pruning's heal step
(Minitron: prune, then distill from the unpruned model).

Teacher cost: `distill.topk = K` reads the teacher's top-k logits from shards computed once
beside the token shards (distill_topk.py; the KL over the top-k ids and a tail bucket) instead of
running the teacher every micro-step. `distill.on_policy = λ` makes a fraction λ of the
micro-batches on-policy (GKD: the student samples, the teacher scores; distill_gkd.py).

The val loss is the student's own cross-entropy on the dataset's val split, so a distilled run's
curve compares with a run trained from scratch. The output is an ordinary run folder (its
tokenizer found through the dataset, as for `kiln train`). The resolved config records the
teacher's (and student's) weights by sha256; resuming with another teacher is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from kiln import config as cfgio
from kiln.config import require
from kiln.errors import KilnError
from kiln.io import sha256_file
from kiln.loading import LoadedModel, find_checkpoint, folder_kind, load_model
from kiln.model.loss import distill_loss, topk_distill_loss, topk_lm_loss
from kiln.model.transformer import Transformer
from kiln.posttrain import distill_gkd as gkd
from kiln.posttrain import distill_topk
from kiln.train.config import TrainConfig
from kiln.train.sources import TokenShards
from kiln.train.trainer import Trainer

LOSSES = ("forward_kl", "reverse_kl")


@dataclass
class DistillSection:
    """The `[distill]` section: the teacher, the loss and where the student starts."""

    teacher: str = ""  # any model folder kiln.loading reads, with the dataset's tokenizer
    loss: Literal["forward_kl", "reverse_kl"] = "forward_kl"
    temperature: float = 2.0  # both distributions softened by τ; the KL is scaled by τ²
    kl_weight: float = 1.0
    ce_weight: float = 0.0  # > 0: mix in the usual next-token cross-entropy
    student: str = ""  # "": a fresh [model]; else a model folder to start from (heal a prune)
    topk: int = 0  # > 0: the teacher's top-k + tail mass from precomputed shards (distill_topk.py)
    topk_dir: str = ""  # "": DATASET/teacher_topk/k{K}_T{seq_len}
    on_policy: float = 0.0  # GKD's λ: the fraction of micro-batches the student samples
    gen_tokens: int = 0  # tokens the student samples per on-policy window; 0: seq_len // 2
    gen_temperature: float = 1.0  # the student's sampling temperature (0: greedy)
    # Filled in when the run starts: the weights files and their sha256.
    teacher_weights: str = ""
    teacher_sha256: str = ""
    student_weights: str = ""
    student_sha256: str = ""

    def __post_init__(self) -> None:
        require(bool(self.teacher), "distill.teacher: give the teacher model folder")
        require(self.loss in LOSSES, f"distill.loss must be one of {', '.join(LOSSES)}; "
                f"got {self.loss!r}")  # fmt: skip
        require(self.temperature > 0, f"distill.temperature must be > 0, got {self.temperature}")
        require(self.kl_weight >= 0, f"distill.kl_weight must be >= 0, got {self.kl_weight}")
        require(self.ce_weight >= 0, f"distill.ce_weight must be >= 0, got {self.ce_weight}")
        require(self.topk >= 0, f"distill.topk must be >= 0 (0: the online teacher): {self.topk}")
        require(
            self.topk == 0 or self.loss == "forward_kl",
            f"distill.topk = {self.topk} needs distill.loss = forward_kl: reverse KL needs the "
            "teacher's probability of every token the student gives mass to, and the shards "
            "hold only the top-k",
        )
        require(0 <= self.on_policy <= 1, f"distill.on_policy must be in [0, 1]: {self.on_policy}")
        require(self.gen_tokens >= 0, f"distill.gen_tokens must be >= 0: {self.gen_tokens}")
        require(self.gen_temperature >= 0, "distill.gen_temperature must be >= 0")
        require(
            self.on_policy == 0 or self.kl_weight > 0,
            "distill.on_policy > 0 needs distill.kl_weight > 0 (on-policy batches are KL only)",
        )
        require(
            self.kl_weight + self.ce_weight > 0,
            "distill.kl_weight and distill.ce_weight are both 0: nothing to learn from",
        )


@dataclass
class DistillConfig(TrainConfig):
    """A distillation run: TrainConfig's sections plus [distill]."""

    distill: DistillSection = field(default_factory=DistillSection)


def load_distill_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> DistillConfig:
    """Read a DistillConfig from TOML with `--set` overrides; errors name the file and the key."""
    return cfgio.load(DistillConfig, path, overrides)


# ---- the loss -----------------------------------------------------------------------------------


class DistillStep:
    """What the Trainer calls per micro-batch: the student's loss against the frozen teacher."""

    def __init__(
        self,
        student: Any,
        teacher: Transformer,
        section: DistillSection,
        seed: int = 0,
        micro: int = 0,
        sampler: nn.Module | None = None,
    ) -> None:
        # seed, micro: the on-policy draws of micro-step `micro` onwards (a resumed run's index);
        # sampler: the module the student samples with (the bare model, not a DDP wrapper).
        self.student, self.teacher, self.section = student, teacher, section
        self.seed, self.micro = seed, micro
        self.sampler = sampler if sampler is not None else student
        self.last_sequence: Tensor | None = None  # the last on-policy batch's sampled windows
        # The step's gradient sync (DDP's no_sync, FSDP2's flag) is the student's.
        for name in ("no_sync", "set_requires_gradient_sync"):
            if hasattr(student, name):
                setattr(self, name, getattr(student, name))

    def __call__(self, x: Tensor, y: Tensor, *extra: Tensor) -> Tensor:
        """Mixed KL + CE loss of the student on inputs x (B, T) with next tokens y (B, T)."""
        s = self.section
        topk = extra[-3:] if s.topk else ()  # ids, log-probs, log tail mass (TopkBatch)
        extra = extra[:-3] if s.topk else extra
        micro, self.micro = self.micro, self.micro + 1
        if s.on_policy:
            on, sample_seed = gkd.draws(self.seed, micro, s.on_policy)
            if on:
                return self.on_policy_loss(x, sample_seed)
        if topk and self.fused(self.student):
            m = self.student
            h = m._head_input(m.hidden(x, None, *extra))  # (B, T, C)
            return topk_lm_loss(h, m.lm_head.weight, m.cfg.vocab_size, topk, y, s.temperature,
                                s.kl_weight, s.ce_weight)  # fmt: skip
        logits = self.student(x, None, *extra)  # (B, T, V)
        loss = logits.new_zeros((), dtype=torch.float32)
        if s.kl_weight:
            if topk:
                kl = topk_distill_loss(logits, *topk, y, s.temperature)
            else:
                with torch.no_grad():
                    teacher_logits = self.teacher(x, None, *extra)  # (B, T, V)
                kl = distill_loss(logits, teacher_logits, y, s.loss, s.temperature)
            loss = loss + s.kl_weight * kl
        if s.ce_weight:
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1).clamp_min(-1),
                ignore_index=-1,
            )  # fmt: skip
            loss = loss + s.ce_weight * ce
        return loss

    @staticmethod
    def fused(student: Any) -> bool:
        """Whether the top-k loss can run chunked from hidden states (a bare model, no extras).

        Otherwise the (B, T, V) logits, their softmax and its backward are made in full, which
        costs CPU time a scratch step (the chunked lm_loss) does not spend.
        """
        cfg = getattr(student, "cfg", None)
        return (
            isinstance(student, Transformer)
            and cfg.logit_softcap is None
            and cfg.moe is None
            and type(student).forward is Transformer.forward
        )

    def on_policy_loss(self, x: Tensor, sample_seed: int) -> Tensor:
        """GKD: the student continues each window's prompt; the KL on its sampled tokens."""
        s = self.section
        T = x.size(1)
        n = s.gen_tokens or T // 2
        prompt = x[:, : T - n]
        seq = gkd.sample_continuation(
            self.sampler, prompt, n, s.gen_temperature, self.teacher.cfg.vocab_size, sample_seed
        )
        self.last_sequence = seq
        targets = gkd.generated_targets(seq, T - n)
        logits = self.student(seq, None)
        with torch.no_grad():
            teacher_logits = self.teacher(seq, None)
        return s.kl_weight * distill_loss(logits, teacher_logits, targets, s.loss, s.temperature)


# ---- setting a run up ---------------------------------------------------------------------------


def weights_file(path: str | Path) -> Path:
    """The weights file of a model folder (a checkpoint's, or an HF folder's)."""
    path = Path(path)
    if folder_kind(path) == "hf":
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return path / name
        raise KilnError(f"{path}: no single weights file (model.safetensors) to record")
    return find_checkpoint(path) / "model.safetensors"


def check_same_tokenizer(
    teacher: LoadedModel,
    where: str,
    data: TokenShards,
    role: str = "distill.teacher",
    data_role: str = "data.dataset",
) -> None:
    """Refuse a model whose tokenizer or vocabulary is not the dataset's, naming both."""
    from kiln.tokenizer.formats import read_any

    entry, root = data.dataset.manifest.tokenizer, data.dataset.root
    tok = teacher.tokenizer
    assert tok is not None
    data_path = entry.locate(Path(root))
    if data_path is not None:
        other = read_any(data_path)
        same = (tok.vocab, tok.special_tokens) == (other.vocab, other.special_tokens)
    else:  # the dataset's tokenizer file is gone: its recorded checksum still identifies it
        same = teacher.tokenizer_path is not None and sha256_file(teacher.tokenizer_path) == (
            entry.sha256
        )
    if not same or teacher.model.cfg.vocab_size != data.vocab_size:
        raise KilnError(
            f"{role} {where} (tokenizer {teacher.tokenizer_path}, {tok.n_vocab} tokens, "
            f"model vocab {teacher.model.cfg.vocab_size}) does not match {data_role} {root} "
            f"(tokenizer {data_path or entry.path}, vocab {data.vocab_size}): they need the "
            "same tokenizer"
        )


class TeacherShards(TokenShards):
    """The dataset's shards, fingerprinted with the teacher (and student) weights too.

    The fingerprint must match on resume, so another teacher is refused there.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.weights: dict[str, Any] = {}
        self.topk: distill_topk.TopkShards | None = None  # set: train batches carry the top-k

    def loader(
        self,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        cursor: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> Any:
        """The shards' loader; with top-k shards, the train batches carry their windows' top-k."""
        inner = super().loader(split, seq_len, batch_size, seed, cursor, rank, world_size)
        if split != "train" or self.topk is None:
            return inner
        return distill_topk.TopkLoader(inner, self.topk)

    def fingerprint(self) -> dict[str, Any]:
        """Tokenizer and shard checksums, and the sha256 of the teacher's (student's) weights."""
        return {**super().fingerprint(), **self.weights}


def prepare(cfg: DistillConfig) -> tuple[DistillConfig, TeacherShards, Transformer, Any]:
    """(the resolved config, its data, the teacher in eval mode, the student hook or None)."""
    s = cfg.distill
    if s.on_policy and not s.gen_tokens < cfg.data.seq_len:
        raise KilnError(f"distill.gen_tokens ({s.gen_tokens}) must be < data.seq_len "
                        f"({cfg.data.seq_len}): the window keeps a prompt")  # fmt: skip
    data = TeacherShards(cfg.data.dataset)
    teacher = load_model(s.teacher, device="cpu", dtype="fp32")
    check_same_tokenizer(teacher, s.teacher, data)
    t_weights = weights_file(s.teacher)
    section = dataclasses.replace(
        s, teacher_weights=str(t_weights), teacher_sha256=sha256_file(t_weights)
    )
    model, prepare_model = cfg.model, None
    if s.student:
        student = load_model(s.student, device="cpu", dtype="fp32")
        check_same_tokenizer(student, s.student, data, "distill.student")
        w = weights_file(s.student)
        section = dataclasses.replace(
            section, student_weights=str(w), student_sha256=sha256_file(w)
        )
        model = student_fields(student.model.cfg.to_dict(), cfg.model, s.student)
        state = student.model.state_dict()

        def prepare_model(fresh: Transformer) -> None:
            """The student's weights into the Trainer's fresh model."""
            with torch.no_grad():
                fresh.load_state_dict(state)
            state.clear()

    if s.topk:
        folder = topk_folder(cfg)
        want = topk_manifest(cfg, data, section.teacher_sha256)
        distill_topk.ensure(
            folder, want, False,
            lambda: distill_topk.precompute(
                teacher.model, data.dataset.split("train"), folder, want, str(t_weights)
            ),
        )  # fmt: skip
        data.topk = distill_topk.TopkShards(folder)
        section = dataclasses.replace(section, topk_dir=str(folder))
    resolved = dataclasses.replace(cfg, distill=section, model=model)
    data.weights = {"teacher_sha256": section.teacher_sha256}
    if s.topk:
        data.weights["teacher_topk"] = s.topk
    if section.student_sha256:
        data.weights["student_sha256"] = section.student_sha256
    teacher.model.requires_grad_(False)
    return resolved, data, teacher.model, prepare_model


def topk_folder(cfg: DistillConfig, k: int | None = None) -> Path:
    """Where the run's top-k shards live (distill.topk_dir, or beside the token shards)."""
    s = cfg.distill
    if s.topk_dir:
        return Path(s.topk_dir)
    return distill_topk.default_dir(cfg.data.dataset, k or s.topk, cfg.data.seq_len, s.temperature)


def topk_manifest(cfg: DistillConfig, data: TokenShards, teacher_sha256: str, k: int = 0) -> Any:
    """What the run's top-k shards must have been made from."""
    s = cfg.distill
    return distill_topk.expected_manifest(
        k or s.topk, cfg.data.seq_len, s.temperature, teacher_sha256, data.fingerprint()
    )


def precompute_topk(cfg: DistillConfig, k: int, force: bool) -> dict[str, Any]:
    """`kiln distill CONFIG --precompute-topk K`: write (or check) the shards, train nothing."""
    if k < 1:
        raise KilnError(f"--precompute-topk must be >= 1, got {k}")
    s = cfg.distill
    data = TokenShards(cfg.data.dataset)
    teacher = load_model(s.teacher, device="cpu", dtype="fp32")
    check_same_tokenizer(teacher, s.teacher, data)
    t_weights = weights_file(s.teacher)
    folder = topk_folder(cfg, k)
    want = topk_manifest(cfg, data, sha256_file(t_weights), k)
    teacher.model.requires_grad_(False)
    return distill_topk.ensure(
        folder, want, force,
        lambda: distill_topk.precompute(
            teacher.model, data.dataset.split("train"), folder, want, str(t_weights)
        ),
    )  # fmt: skip


def student_fields(student: dict[str, Any], given: dict[str, Any], where: str) -> dict[str, Any]:
    """The run's [model] when distill.student is set: the student's own config (dropout may change)."""
    student = {k: v for k, v in student.items() if v is not None}
    for key, value in sorted(given.items()):
        if key != "dropout" and student.get(key) != value:
            raise KilnError(
                f"model.{key}: the student is distill.student {where} ({key} = "
                f"{student.get(key)!r}); leave [model] out or give only model.dropout"
            )
    return {**student, **{k: v for k, v in given.items() if k == "dropout"}}


def build_trainer(
    cfg: DistillConfig, run_dir: str | Path, resume: bool = False, **kwargs: Any
) -> Trainer:
    """The Trainer of a distillation run: the student trains on DistillStep's loss."""
    resolved, data, teacher, prepare_model = prepare(cfg)
    trainer = Trainer(
        resolved, run_dir, resume=resume, data=data, prepare_model=prepare_model, **kwargs
    )
    if trainer.plan.pipelined:
        raise KilnError("distillation does not support parallel.pp > 1 (the teacher is not staged)")
    teacher.to(trainer.device)
    s = resolved.distill
    micro = trainer.step * trainer.accum  # where a resumed run's on-policy draws go on from
    trainer.train_model = DistillStep(
        trainer.train_model, teacher, s, resolved.train.seed, micro, trainer.model
    )
    n_student = sum(p.numel() for p in trainer.model.parameters())
    n_teacher = sum(p.numel() for p in teacher.parameters())
    mix = f"{s.kl_weight:g}·{s.loss} (τ={s.temperature:g})"
    if s.ce_weight:
        mix += f" + {s.ce_weight:g}·CE"
    if s.topk:
        mix += f", teacher top-{s.topk} + tail bucket from {s.topk_dir}"
    if s.on_policy:
        mix += f", on-policy fraction {s.on_policy:g} (GKD)"
    trainer.say(f"kiln distill: teacher {s.teacher} ({n_teacher:,} parameters), student "
                f"{n_student:,} parameters{' from ' + s.student if s.student else ''}; "
                f"loss {mix}")  # fmt: skip
    return trainer
