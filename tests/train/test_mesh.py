"""The [parallel] mesh on the CPU: 4 gloo processes, one torchrun launch for the whole module.

TP=2×DP=2, HSDP (2×2), PP=2×DP=2 with each schedule and TP=2×PP=2 give the losses, gradient
norms and first-step gradients of one process with the same global batch (float tolerance);
a sharded checkpoint saved with dp_shard=4 resumes as dp_shard=2×tp=2, on the same mesh (bit
for bit) and in one process; a pipeline stage that raises stops every rank with its error.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.errors import KilnError
from kiln.train.config import ConfigError, load_train_config
from kiln.train.distributed import DistInfo
from kiln.train.parallelize import parallel_mode
from kiln.train.pipeline import balanced_ranges
from kiln.train.trainer import Trainer

from .conftest import CONFIGS, MakeConfig
from .mesh_worker import capture_first_gradients
from .test_distributed import ROOT, TOL, _torchrun_command, needs_gloo

WORKER = Path(__file__).with_name("mesh_worker.py")
STEPS = 4
# Pipeline runs: 4 blocks (2 stages per rank for interleaved 1F1B), an untied head (the
# embedding and head live on different stages), micro-batches of 1 (4 per pipeline step).
PP = ["model.n_layer=4", "model.tie_embeddings=false", "batch.micro_batch=1", "eval.batches=0"]
# The stage runs the model's own embed / blocks / head: the switches they hold work there too.
PP_SWITCHES = [*PP, "model.embed_scale=true", "model.attn_sinks=true", "model.mup_base_width=32",
               "model.rope_scaling.type=dynamic", "model.rope_scaling.factor=2.0",
               "model.rope_scaling.original_max_seq_len=16"]  # fmt: skip
PP_SINUSOIDAL = [*PP, "model.pos_emb=sinusoidal"]
MESH_RUNS: dict[str, list[str]] = {
    "tp2_dp2": ["parallel.tp=2"],
    "tp2_dp2_no_sp": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "pp_gpipe": [*PP, "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp_1f1b": [*PP, "parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp_interleaved": [*PP, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
    "tp2_pp2": [*PP, "parallel.pp=2", "parallel.tp=2"],
    "pp_switches": [*PP_SWITCHES, "parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp_sinusoidal": [*PP_SINUSOIDAL, "parallel.pp=2"],
    "dp4": ["train.parallel=mesh", "checkpoint.every=2", "checkpoint.keep_last=3"],
}  # fmt: skip
# The one-process run each mesh run is compared with (default: "plain").
REFERENCE = {"pp_gpipe": "pp", "pp_1f1b": "pp", "pp_interleaved": "pp", "tp2_pp2": "pp",
             "pp_switches": "pp_switches", "pp_sinusoidal": "pp_sinusoidal"}  # fmt: skip


def _torchrun(args: list[str], nproc: int = 4, timeout: float = 300) -> subprocess.CompletedProcess:
    """`args` in `nproc` local gloo processes (as test_distributed starts them)."""
    cmd, env = _torchrun_command(args, nproc)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _base(dataset: Path, run_dir: Path) -> list[str]:
    return [
        f"data.dataset={dataset}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        f"train.max_steps={STEPS}",
        "eval.every=0",
        "eval.sample_tokens=0",
        "batch.micro_batch=2",
    ]  # fmt: skip  (4 data-parallel ranks × 2 = the global batch)


@pytest.fixture(scope="module")
def mesh_runs(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every mesh run above, then the dp_shard=4 checkpoint resumed on two meshes, in one launch."""
    root = tmp_path_factory.mktemp("mesh")
    runs: list[dict[str, Any]] = [
        {"name": name, "sets": [*_base(tiny_dataset, root / name), *sets]}
        for name, sets in MESH_RUNS.items()
    ]
    dp4 = MESH_RUNS["dp4"]
    for name, sets in (("dp4_as_tp2", [*dp4, "train.parallel=auto", "parallel.tp=2"]),
                       ("dp4_again", dp4)):  # fmt: skip
        runs.append(
            {"name": name, "sets": [*_base(tiny_dataset, root / name), *sets], "resume": True,
             "start_from": [str(root / "dp4"), 2]}
        )  # fmt: skip
    plan = root / "plan.json"
    plan.write_text(json.dumps({"runs": runs}))
    done = _torchrun([str(WORKER), str(plan)])
    if done.returncode:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return root


def _result(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / f"{name}.json").read_text())


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def references(tiny_dataset: Path, mesh_runs: Path) -> dict[str, Path]:
    """One process, the same global batches: the tiny model and the pipeline runs' model."""
    out = {}
    for name, sets in (("plain", []), ("pp", PP), ("pp_switches", PP_SWITCHES),
                       ("pp_sinusoidal", PP_SINUSOIDAL)):  # fmt: skip
        run = mesh_runs / f"single_{name}"
        cfg = load_train_config(CONFIGS / "tiny.toml", [*_base(tiny_dataset, run), *sets])
        trainer = Trainer(cfg, run)
        capture_first_gradients(trainer, mesh_runs / f"single_{name}.grads.pt")
        trainer.run()
        out[name] = run
    return out


@needs_gloo
@pytest.mark.parametrize("name", [n for n in MESH_RUNS if n != "dp4"])
def test_mesh_run_matches_one_process(
    name: str, mesh_runs: Path, references: dict[str, Path]
) -> None:
    ref = REFERENCE.get(name, "plain")
    mesh, single = _records(mesh_runs / name), _records(references[ref])
    assert [r["step"] for r in mesh] == [r["step"] for r in single] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "val_loss"):
        a, b = [r.get(key) for r in single], [r.get(key) for r in mesh]
        assert [v is None for v in a] == [v is None for v in b], key
        assert [v for v in b if v is not None] == pytest.approx(
            [v for v in a if v is not None], **TOL
        ), key
    ga = torch.load(mesh_runs / f"single_{ref}.grads.pt")
    gb = torch.load(mesh_runs / f"{name}.grads.pt")
    assert set(gb) == set(ga)
    for k in gb:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=k)


@needs_gloo
def test_sharded_checkpoint_has_no_whole_state_and_appears_complete(mesh_runs: Path) -> None:
    ckpts = mesh_runs / "dp4" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS}"
    step = ckpts / "step_2"
    assert sorted(p.name for p in step.iterdir()) == ["dcp", "state.json"]
    shards = sorted(p.name for p in (step / "dcp").iterdir())
    assert shards == [".metadata", *[f"__{r}_0.distcp" for r in range(4)]]  # one file per rank
    assert not list(ckpts.glob(".tmp-*"))
    state = json.loads((step / "state.json").read_text())
    assert set(state["rng"]) == {"0", "1", "2", "3"} and state["step"] == 2


@needs_gloo
def test_resume_on_the_same_mesh_is_bit_exact(mesh_runs: Path) -> None:
    straight = [r["loss"] for r in _records(mesh_runs / "dp4")]
    assert _result(mesh_runs, "dp4_again")["losses"] == straight[2:]
    a = [r["grad_norm"] for r in _records(mesh_runs / "dp4")][2:]
    assert [r["grad_norm"] for r in _records(mesh_runs / "dp4_again")] == a


@needs_gloo
def test_resume_on_another_mesh_continues_the_run(mesh_runs: Path) -> None:
    """dp_shard=4 -> dp_shard=2 × tp=2: the same next losses up to the reduction order."""
    straight = _records(mesh_runs / "dp4")
    assert [r["step"] for r in _records(mesh_runs / "dp4_as_tp2")] == list(range(3, STEPS + 1))
    got = _result(mesh_runs, "dp4_as_tp2")
    assert got["step"] == STEPS
    assert got["losses"] == pytest.approx([r["loss"] for r in straight][2:], **TOL)
    assert got["val_loss"] == pytest.approx(straight[-1]["val_loss"], **TOL)


@needs_gloo
def test_resume_in_one_process(mesh_runs: Path, make_config: MakeConfig, tmp_path: Path) -> None:
    """The 4-process dp_shard=4 checkpoint continues in one process (train.parallel = mesh)."""
    from .mesh_worker import start_from

    run = tmp_path / "one"
    start_from(mesh_runs / "dp4", 2, run)
    cfg = make_config(*_base(mesh_runs, run)[3:], *MESH_RUNS["dp4"], run="one")
    trainer = Trainer(cfg, run, resume=True)
    assert trainer.step == 2 and trainer.plan.mode == "mesh" and trainer.accum == 4
    result = trainer.run()
    straight = _records(mesh_runs / "dp4")
    assert result.losses == pytest.approx([r["loss"] for r in straight][2:], **TOL)
    assert result.val_loss == pytest.approx(straight[-1]["val_loss"], **TOL)


@needs_gloo
def test_a_raising_pipeline_stage_stops_every_rank(tiny_dataset: Path, tmp_path: Path) -> None:
    """The last stage raises at step 2: every rank stops with the error, well before a timeout."""
    run = {"name": "boom", "sets": [*_base(tiny_dataset, tmp_path / "boom"), *PP, "parallel.pp=2"],
           "raise_at": 2}  # fmt: skip
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"runs": [run]}))
    done = _torchrun([str(WORKER), str(plan)], timeout=150)  # a hang fails as TimeoutExpired
    assert done.returncode != 0
    assert "stage raised on purpose at step 2" in done.stderr + done.stdout
    assert not (tmp_path / "boom.json").exists()


# ---- without processes ------------------------------------------------------------------------


def test_mesh_sizes_are_checked_against_the_world_size(tiny_dataset: Path) -> None:
    def cfg(*sets: str) -> Any:
        return load_train_config(CONFIGS / "tiny.toml", [f"data.dataset={tiny_dataset}", *sets])

    assert cfg("parallel.tp=2").parallel.shape(8) == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2
    }  # fmt: skip
    assert parallel_mode(cfg("parallel.tp=2"), DistInfo(0, 4)) == "mesh"
    assert parallel_mode(cfg("train.parallel=fsdp"), DistInfo(0, 4)) == "fsdp"  # 1-D: as before
    assert parallel_mode(cfg(), DistInfo()) == "none"
    with pytest.raises(KilnError, match=r"= 6 but WORLD_SIZE=4"):
        parallel_mode(cfg("parallel.tp=2", "parallel.dp_shard=3"), DistInfo(0, 4))
    with pytest.raises(KilnError, match=r"= 3 does not divide WORLD_SIZE=4"):
        parallel_mode(cfg("parallel.tp=3"), DistInfo(0, 4))
    with pytest.raises(KilnError, match=r"train\.parallel = 'ddp' cannot"):
        parallel_mode(cfg("parallel.pp=2", "train.parallel=ddp"), DistInfo(0, 2))
    with pytest.raises(ConfigError, match=r"parallel\.pp_schedule"):
        cfg("parallel.pp_schedule=zb")
    with pytest.raises(ConfigError, match=r"parallel\.tp must be >= 1"):
        cfg("parallel.tp=0")


def test_pipeline_stages_are_balanced_by_parameters() -> None:
    assert balanced_ranges([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_ranges([1, 1, 1, 1], 2, first=0, last=2) == [range(0, 3), range(3, 4)]
    assert balanced_ranges([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    with pytest.raises(KilnError, match="need at least 3 blocks"):
        balanced_ranges([1, 1], 3)


def test_one_process_mesh_run_with_activation_checkpointing(make_config: MakeConfig) -> None:
    """train.parallel = mesh in one process (split projections, AC on every 2nd block) = plain."""
    plain = make_config("train.max_steps=3", run="plain")
    cfg = make_config("train.max_steps=3", "train.parallel=mesh",
                      "parallel.activation_checkpointing=full", "parallel.ac_every=2", run="ac")  # fmt: skip
    meshed = Trainer(cfg, cfg.logging.run_dir)
    assert "blocks.0.attn.qkv.q.weight" in dict(meshed.model.named_parameters())
    blocks = meshed.model.blocks
    assert "forward" in vars(blocks[0]) and "forward" not in vars(blocks[1])  # every 2nd
    expected = Trainer(plain, plain.logging.run_dir).run().losses
    assert meshed.run().losses == pytest.approx(expected, rel=1e-6)


@needs_gloo
def test_export_of_a_sharded_checkpoint_equals_the_whole_model_export(
    mesh_runs: Path, tmp_path: Path
) -> None:
    """`kiln export` of the dp_shard=4 run: the tensors state_dict_to_hf gives the whole model."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from kiln.cli import main
    from kiln.model import ModelConfig, Transformer
    from kiln.model.hf import state_dict_to_hf

    from .mesh_worker import fuse

    out = tmp_path / "hf"
    assert main(["export", str(mesh_runs / "dp4"), "--hf", str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    step = mesh_runs / "dp4" / "checkpoints" / f"step_{STEPS}"
    dcp_to_torch_save(step / "dcp", tmp_path / "whole.pt")  # the test may gather it all
    whole = fuse(torch.load(tmp_path / "whole.pt")["model"])
    state = json.loads((step / "state.json").read_text())
    model = Transformer(ModelConfig.from_dict(state["config"]["model"]))
    model.load_state_dict(whole, strict=False)  # a tied head is the embedding
    expected = state_dict_to_hf(model)
    assert exported.keys() == expected.keys()
    for k in expected:
        assert torch.equal(exported[k], expected[k]), k
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_async_sharded_saves_appear_complete_and_resume_exactly(make_config: MakeConfig) -> None:
    """One process, parallel.async_checkpoint: step_2 and step_4 published whole, step 2 resumes."""
    sets = ("train.parallel=mesh", "parallel.async_checkpoint=true", "train.max_steps=4",
            "checkpoint.every=2", "checkpoint.keep_last=3", "eval.every=0")  # fmt: skip
    cfg = make_config(*sets, run="async")
    straight = Trainer(cfg, cfg.logging.run_dir).run()
    ckpts = Path(cfg.logging.run_dir) / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_4"
    for step in (2, 4):
        assert (ckpts / f"step_{step}" / "dcp" / ".metadata").is_file()
        assert (ckpts / f"step_{step}" / "state.json").is_file()
    assert not list(ckpts.glob(".tmp-*"))
    from .mesh_worker import start_from

    again = make_config(*sets, run="again")
    start_from(Path(cfg.logging.run_dir), 2, Path(again.logging.run_dir))
    resumed = Trainer(again, again.logging.run_dir, resume=True).run()
    assert resumed.losses == straight.losses[2:]
