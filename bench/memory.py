"""The memory pre-flight's prediction against measured peak memory, on the CPU.

    python bench/memory.py DATASET_DIR            # the three configurations of bench/RESULTS.md

Each configuration trains 2 steps in fresh processes (torchrun for the 2-process one), with
glibc told to mmap large blocks and give them back at free. Measured peak = the process's peak
resident set (ru_maxrss) minus its resident set just before the Trainer is built (after
imports); on 2 processes, the larger rank's. It includes what the prediction leaves out: torch's
runtime and kernel workspaces, the loader, the checkpoint written at the last step.
Beside it: kiln.train.preflight's predicted peak per rank, and the saved-activation bytes of
one micro-batch, measured with autograd's saved-tensor hooks (each storage counted once) against
kiln.model.accounting.activation_bytes, the figure `kiln scaling account` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

MODEL = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.n_kv_head=2",
         "model.block_size=256", "data.seq_len=256", "train.max_steps=2", "eval.batches=0",
         "eval.sample_tokens=0", "checkpoint.every=0", "logging.progress=false"]  # fmt: skip
CONFIGS = {
    "1 process, no checkpointing, micro-batch 16": (1, ["batch.micro_batch=16",
                                                        "batch.global_tokens=8192"]),
    "1 process, full activation checkpointing, micro-batch 16": (1, [
        "batch.micro_batch=16", "batch.global_tokens=8192", "train.parallel=mesh",
        "parallel.activation_checkpointing=full"]),
    "2 processes, FSDP2 (mesh dp_shard=2), micro-batch 8": (2, [
        "batch.micro_batch=8", "batch.global_tokens=8192", "train.parallel=mesh"]),
}  # fmt: skip


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def saved_activation_bytes(trainer: object) -> int:
    """Bytes autograd saves for backward in one training forward (each storage once)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = trainer.loader.next_batch().to_torch(trainer.device)  # type: ignore[attr-defined]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.train_model(x, y)  # type: ignore[attr-defined]
    del loss
    params = {
        getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
        for p in trainer.model.parameters()  # type: ignore[attr-defined]
    }
    return sum(n for ptr, n in seen.items() if ptr not in params)


def child(dataset: str, out: str, sets: list[str]) -> None:
    """One process of one configuration: train 2 steps, report the numbers (rank 0 writes)."""
    import torch

    from kiln.model.accounting import activation_bytes
    from kiln.train.config import load_train_config
    from kiln.train.preflight import rank_memory
    from kiln.train.trainer import Trainer

    torch.set_num_threads(1)
    run = tempfile.mkdtemp(prefix="kiln-mem-")
    cfg = load_train_config(
        ROOT / "configs" / "tiny.toml",
        [f"data.dataset={dataset}", f"logging.run_dir={run}", "train.dtype=fp32", *sets],
    )
    before = _rss()
    trainer = Trainer(cfg, run)
    shape = trainer.plan.mesh.shape
    predicted = rank_memory(trainer.model_cfg, trainer.cfg, shape, "fp32", cfg.batch.micro_batch)
    trainer.run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    saved = saved_activation_bytes(trainer)  # after the peak was read: it is not part of it
    ac = cfg.parallel.activation_checkpointing == "full"
    account = activation_bytes(
        trainer.model_cfg, cfg.batch.micro_batch, cfg.data.seq_len, "fp32", checkpointing=ac
    )
    doc = {"rank": trainer.dist.rank, "measured_peak": peak, "predicted": predicted.total,
           "parts": predicted.parts(), "saved_measured": saved, "saved_account": account,
           "params": trainer.model_cfg.num_params()}  # fmt: skip
    Path(f"{out}.{trainer.dist.rank}").write_text(json.dumps(doc))


def main(argv: list[str]) -> int:
    """Every configuration, side by side."""
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", help="a kiln dataset directory (`kiln data tokenize` output)")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    measured = begin("bench/memory.py", args.noisy)
    dataset = args.dataset
    # Large blocks from mmap, given back at free: the resident set then follows live memory
    # instead of glibc's high-water mark of freed-but-kept arenas.
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    env = {**os.environ, **malloc, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    print("| configuration | predicted peak / rank | measured peak / rank | ratio | "
          "saved activations: account | measured | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (nproc, sets) in CONFIGS.items():
        out = tempfile.mktemp(prefix="kiln-mem-out-")
        args = [str(Path(__file__).resolve()), "--child", dataset, out, *MODEL, *sets]
        if nproc == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--standalone", *args]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        docs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)]
        doc = max(docs, key=lambda d: d["measured_peak"])
        mib = 2**20
        print(
            f"| {name} | {doc['predicted'] / mib:.1f} MiB | {doc['measured_peak'] / mib:.1f} MiB "
            f"| {doc['measured_peak'] / doc['predicted']:.2f} | {doc['saved_account'] / mib:.1f} "
            f"MiB | {doc['saved_measured'] / mib:.1f} MiB | "
            f"{doc['saved_measured'] / doc['saved_account']:.2f} |"
        )
        print(f"<!-- {name}: {json.dumps(doc['parts'])} params {doc['params']:,} -->")
    print(measured.line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
