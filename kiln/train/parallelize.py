"""The [parallel] mesh: tensor, pipeline and hybrid data parallelism applied from outside the model.

`build_mesh` lays the processes out as a DeviceMesh of shape (pp, dp_replicate, dp_shard, tp),
tp innermost so that a tensor-parallel group is the closest ranks. `parallelize_mesh` then
changes a kiln Transformer in place, in torchtitan's order:

1. split fused projections: the attention's fused `qkv` becomes `qkv.q`, `qkv.k`, `qkv.v`
   and SwiGLU's fused `fc` becomes `fc.gate`, `fc.up` (`SplitLinear`, whose forward is the
   concatenation the model expects). A column-wise shard of a fused matrix would give rank 0
   all of q and part of k; split, each part shards on its own and every rank gets its heads'
   q, k and v. Done on every mesh (tp = 1 too), so a sharded checkpoint has the same names
   whatever the mesh and reshards by name (see sharded_checkpoint.py);
2. tensor parallelism on the "tp" dimension (`parallelize_module`): q/k/v and gate/up
   column-wise, the two output projections row-wise; with `sequence_parallel` the norms and
   the residual stream between blocks are split on the sequence dimension (the attention and
   MLP inputs are all-gathered, their outputs reduce-scattered). The attention modules are
   told their local head counts (n_head / tp): the model reshapes by them;
3. activation checkpointing of every k-th block (`torch.utils.checkpoint`);
4. per-block compile (train.compile);
5. FSDP2 over the data-parallel dimensions: each block, then the root; HSDP (replicate ×
   shard, a 2-D mesh) when dp_replicate > 1.

Pipeline parallelism (the "pp" dimension) splits the blocks into stages first; see pipeline.py.
The model file is untouched: everything here acts on module instances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.train.config import TrainConfig
from kiln.train.distributed import DistInfo

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Mesh:
    """This process's place on the [parallel] mesh (one process: every size 1, no DeviceMesh)."""

    shape: dict[str, int]
    device_mesh: Any = None  # torch DeviceMesh over MESH_DIMS, None with one process
    coords: dict[str, int] | None = None

    def size(self, dim: str) -> int:
        """The size of one mesh dimension."""
        return self.shape[dim]

    def rank(self, dim: str) -> int:
        """This process's coordinate on one mesh dimension."""
        return 0 if self.coords is None else self.coords[dim]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own part of every global batch."""
        return self.shape["dp_replicate"] * self.shape["dp_shard"]

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index (the loader's rank)."""
        return self.rank("dp_replicate") * self.shape["dp_shard"] + self.rank("dp_shard")

    @property
    def owns_loss(self) -> bool:
        """Whether this rank's loss counts: the last pipeline stage, first tensor-parallel rank."""
        return self.rank("pp") == self.size("pp") - 1 and self.rank("tp") == 0

    def sub(self, *dims: str) -> Any:
        """The DeviceMesh of some dimensions (None with one process)."""
        return None if self.device_mesh is None else self.device_mesh[dims]

    def describe(self) -> str:
        """One line for the log: the mesh's sizes."""
        sizes = " × ".join(f"{d}={self.shape[d]}" for d in MESH_DIMS)
        return f"mesh {sizes} ({self.dp_size} data-parallel)"


def build_mesh(cfg: TrainConfig, world_size: int, device: torch.device) -> Mesh:
    """The mesh of cfg.parallel over `world_size` processes, checked (one clear error if not)."""
    shape = cfg.parallel.shape(world_size)
    _check_model_fits_mesh(cfg, shape)
    if world_size == 1:
        return Mesh(shape)
    from torch.distributed.device_mesh import init_device_mesh

    sizes = tuple(shape[d] for d in MESH_DIMS)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=MESH_DIMS)
    coords = dict(zip(MESH_DIMS, mesh.get_coordinate() or [0] * 4, strict=True))
    return Mesh(shape, mesh, coords)


def _check_model_fits_mesh(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """Head, kv-head and MLP widths must split over tp; blocks must cover the pipeline stages."""
    tp, model = shape["tp"], cfg.model
    if tp > 1:
        n_head, n_kv = model.get("n_head", 1), model.get("n_kv_head") or model.get("n_head", 1)
        for name, value in (("n_head", n_head), ("n_kv_head", n_kv)):
            if value % tp:
                raise KilnError(f"parallel.tp = {tp} does not divide model.{name} = {value}")
        if model.get("qk_norm"):
            raise KilnError("parallel.tp > 1 with model.qk_norm is not supported yet")
    _check_mesh_supports(cfg.model_config(), shape)


def _check_mesh_supports(model: ModelConfig, shape: dict[str, int]) -> None:
    """Refuse, in one line, what the mesh path does not split or the pipeline stage does not run.

    The mesh splits dense GQA attention and dense MLPs; a pipeline stage runs the model's own
    embedding, blocks and head (kiln/train/pipeline.py), all but MoE's auxiliary losses.
    """
    if model.mla is not None:
        raise KilnError("the [parallel] mesh does not split MLA attention (model.mla) yet; train "
                        "it with train.parallel = 'ddp' or 'fsdp'")  # fmt: skip
    if model.has_recurrent_layers and (shape["tp"] > 1 or shape["pp"] > 1):
        raise KilnError(f"the [parallel] mesh does not split or stage recurrent layers "
                        f"(model.layer_pattern = {model.layer_pattern!r}) yet; train them with "
                        "tp = 1 and pp = 1 (ddp or fsdp)")  # fmt: skip
    if model.moe is not None and shape["tp"] > 1:
        raise KilnError("parallel.tp > 1 does not split MoE experts (model.moe) yet; use tp = 1")
    if shape["pp"] > 1 and model.moe is not None:  # the stages run the model's own code, but
        # the schedule's loss sees only the last stage's logits, not every block's balancing loss
        raise KilnError("parallel.pp > 1 does not collect model.moe's load-balancing loss across "
                        "stages yet; use pp = 1")  # fmt: skip


# ---- 1. split fused projections ---------------------------------------------------------------


class SplitLinear(nn.Module):
    """A fused nn.Linear as one Linear per part; forward concatenates them as the fused one did."""

    def __init__(self, fused: nn.Linear, parts: dict[str, int]) -> None:
        super().__init__()
        if sum(parts.values()) != fused.out_features:
            raise KilnError(f"parts {parts} do not add up to {fused.out_features} outputs")
        self.names = list(parts)
        start = 0
        for name, size in parts.items():
            part = nn.Linear(
                fused.in_features, size, bias=fused.bias is not None,
                device=fused.weight.device, dtype=fused.weight.dtype,
            )  # fmt: skip
            with torch.no_grad():
                part.weight.copy_(fused.weight[start : start + size])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[start : start + size])
            setattr(self, name, part)
            start += size

    def forward(self, x: Tensor) -> Tensor:
        """(..., C_in) -> (..., sum of the parts' local widths)."""
        return torch.cat([getattr(self, name)(x) for name in self.names], dim=-1)


def split_fused(model: nn.Module) -> None:
    """Replace every block's fused qkv (and SwiGLU fc) with a SplitLinear, in place."""
    for block in blocks_of(model):
        if getattr(block, "in_proj", None) is not None:  # parallel block: qkv + MLP in one matrix
            raise KilnError(
                "tensor parallelism does not split a parallel block's fused input projection; "
                "set model.parallel_norms = 2 (unfused) or parallel.tp = 1"
            )
        attn = block.attn
        if isinstance(attn.qkv, nn.Linear):
            q, kv = attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim
            attn.qkv = SplitLinear(attn.qkv, {"q": q, "k": kv, "v": kv})
        mlp = getattr(block, "mlp", None)
        if getattr(mlp, "swiglu", False) and isinstance(mlp.fc, nn.Linear):
            half = mlp.fc.out_features // 2
            mlp.fc = SplitLinear(mlp.fc, {"gate": half, "up": half})


def fused_name(name: str) -> tuple[str, str] | None:
    """(fused tensor name, part) for a split tensor's name, e.g. ...qkv.k.weight -> (...qkv.weight, k)."""
    head, _, leaf = name.rpartition(".")
    module, _, part = head.rpartition(".")
    if part in ("q", "k", "v") and module.endswith(".qkv"):
        return f"{module}.{leaf}", part
    if part in ("gate", "up") and module.endswith(".fc"):
        return f"{module}.{leaf}", part
    return None


FUSED_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


# ---- 2. tensor parallelism --------------------------------------------------------------------


def apply_tp(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Megatron-style plans on every block (and the sequence-parallel edges at the root)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    out = Shard(1) if sequence_parallel else Replicate()
    for block in blocks_of(model):
        attn, mlp = block.attn, block.mlp
        plan: dict[str, Any] = {f"attn.qkv.{p}": ColwiseParallel() for p in attn.qkv.names}
        plan["attn.proj"] = RowwiseParallel(output_layouts=out)
        fc_parts = mlp.fc.names if isinstance(mlp.fc, SplitLinear) else None
        if fc_parts:
            plan.update({f"mlp.fc.{p}": ColwiseParallel() for p in fc_parts})
        else:
            plan["mlp.fc"] = ColwiseParallel()
        plan["mlp.proj"] = RowwiseParallel(output_layouts=out)
        if sequence_parallel:
            plan["norm1"] = SequenceParallel(use_local_output=True)
            plan["norm2"] = SequenceParallel(use_local_output=True)
            # The attention and MLP see the whole sequence: gather it at their inputs.
            plan["attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
                use_local_output=True,
            )
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )  # fmt: skip
        parallelize_module(block, tp_mesh, plan)
        # The model reshapes q, k, v by its head counts: this rank holds 1/tp of the heads.
        attn.n_head //= tp
        attn.n_kv_head //= tp
    if not sequence_parallel:
        return
    # Embeddings stay whole on every tp rank; the residual stream is split on T after the
    # embedding dropout, and the final norm's output is gathered again for the head and loss.
    # (A pipeline stage may have neither end; its stage boundary carries the split stream.)
    if hasattr(model, "seq_shards"):
        model.seq_shards = tp
    if hasattr(model, "drop"):
        split = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
        parallelize_module(model.drop, tp_mesh, split)
    if hasattr(model, "norm_f"):
        parallelize_module(model.norm_f, tp_mesh, SequenceParallel(use_local_output=False))
        gather = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
        parallelize_module(model.norm_f, tp_mesh, gather)


# ---- 3. activation checkpointing, 4. compile ------------------------------------------------


def checkpointed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks recomputed in backward: none, or every `every`-th (0, k, 2k, ...)."""
    return [] if mode == "none" else list(range(0, n_blocks, every))


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each given block's forward in backward instead of keeping its activations."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Tensor:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # an instance attribute: names and the module tree unchanged


# ---- 5. FSDP2 / HSDP ----------------------------------------------------------------------------


def apply_fsdp(model: nn.Module, dp_mesh: Any) -> nn.Module:
    """FSDP2: each block its own shard group (gathered only while it runs), then the root.

    The root group holds the embeddings, final norm and head; a tied head is the embedding's own
    Parameter, so both live in that one group and stay tied. In place; returns `model`.
    """
    from torch.distributed.fsdp import fully_shard

    for block in blocks_of(model):
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def apply_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel over all ranks (gradients averaged in buckets during backward)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def dp_mesh_of(mesh: Mesh) -> Any:
    """The data-parallel DeviceMesh FSDP shards over: 2-D (replicate, shard) for HSDP."""
    if mesh.size("dp_replicate") > 1:
        return mesh.sub("dp_replicate", "dp_shard")
    return mesh.sub("dp_shard")


def parallelize_mesh(model: nn.Module, cfg: TrainConfig, mesh: Mesh) -> nn.Module:
    """Steps 1-5 on `model` (or on one pipeline stage of it), in place; returns it."""
    split_fused(model)
    if mesh.size("tp") > 1:
        apply_tp(model, mesh.sub("tp"), cfg.parallel.sequence_parallel)
    par = cfg.parallel
    blocks = blocks_of(model)
    chosen = checkpointed_blocks(len(blocks), par.activation_checkpointing, par.ac_every)
    apply_activation_checkpointing(blocks[i] for i in chosen)
    if cfg.train.compile:
        for block in blocks:
            block.compile()
    # With tp > 1, FSDP even over one data-parallel rank: then every parameter is a DTensor
    # (the optimizer's fused/foreach kernels refuse plain tensors mixed with DTensors).
    if mesh.dp_size > 1 or mesh.size("tp") > 1:
        apply_fsdp(model, dp_mesh_of(mesh))
    return model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks of a Transformer (a ModuleList) or of a pipeline stage (a ModuleDict)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    raise KilnError(f"{type(model).__name__} has no `blocks` to parallelise")


# ---- 1-D data parallelism (train.parallel = "ddp" / "fsdp"), one process --------------------


def parallel_mode(cfg: TrainConfig, dist: DistInfo) -> str:
    """The parallelism used: "mesh" ([parallel], above), else "none" on one process, else
    train.parallel ("auto": ddp). The [parallel] sizes are checked against the world size.
    """
    mode = cfg.train.parallel
    if cfg.parallel.multi_dim or mode == "mesh" or cfg.parallel.dp_shard != -1:
        cfg.parallel.shape(dist.world_size)  # one clear error when the sizes do not multiply out
    if cfg.parallel.multi_dim or mode == "mesh":
        if mode in ("ddp", "none"):
            raise KilnError(
                f"[parallel] asks for tp, pp or dp_replicate > 1, which train.parallel = {mode!r} "
                "cannot do; use 'auto' or 'mesh'"
            )
        return "mesh"
    if dist.world_size == 1:
        return "none"
    if mode == "none":
        raise KilnError(
            f"train.parallel = 'none' with {dist.world_size} processes would train "
            f"{dist.world_size} unrelated models; use 'ddp' or 'fsdp' (or 'auto')"
        )
    return "ddp" if mode == "auto" else mode


def parallelize_1d(model: nn.Module, cfg: TrainConfig, mode: str, world_size: int) -> nn.Module:
    """The module to train for mode "none", "ddp" or "fsdp": compiled (if asked) and wrapped.

    One process trains the model as it is (compiled whole when train.compile is set). With
    several, compile goes per block first (so FSDP's hooks and DDP's bucketing stay outside the
    compiled graphs, as torchtitan does), then DDP or FSDP2 on a 1-D mesh; FSDP2 changes `model`
    in place (its parameters become DTensor shards) and returns it.
    """
    if mode == "none":
        return torch.compile(model) if cfg.train.compile else model
    if cfg.train.compile:
        for block in blocks_of(model):
            block.compile()  # in place: parameter names and the module tree are unchanged
    if mode == "ddp":
        return apply_ddp(model)
    from torch.distributed.device_mesh import init_device_mesh

    device = next(model.parameters()).device
    return apply_fsdp(model, init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",)))


# ---- numbers across the mesh ----------------------------------------------------------------


def loss_and_clip(
    local_loss: Tensor, params: list[nn.Parameter], max_norm: float, mesh: Mesh
) -> tuple[float, Tensor]:
    """(the step's global loss, the global gradient norm), gradients clipped if max_norm > 0."""
    loss = global_loss(local_loss, mesh)
    norm = grad_norm(params, mesh)
    if max_norm > 0:
        clip_grads(params, max_norm, norm)
    return loss, norm


def grad_norm(params: list[nn.Parameter], mesh: Mesh) -> Tensor:
    """The global 2-norm of the gradients (a plain fp32 scalar), whatever each one's sharding.

    DTensor gradients on different meshes (TP blocks on (dp, tp), embeddings on dp) cannot
    share one norm call: each group's norm is made whole with full_tensor(), the squares are
    added, and with pipeline stages summed over the "pp" ranks (each holds other parameters).
    """
    groups: dict[Any, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norms.append(norm.detach().float().cpu())
    if len(norms) == 1 and mesh.size("pp") == 1:
        return norms[0]  # one group (one process, DDP, 1-D FSDP): its norm as torch made it
    square = torch.zeros((), dtype=torch.float32)
    for norm in norms:
        square = square + norm**2
    if mesh.size("pp") > 1:
        device = params[0].device if params else torch.device("cpu")
        square = square.to(device)
        tdist.all_reduce(square, group=mesh.sub("pp").get_group())
    return square.sqrt().cpu()


def clip_grads(params: list[nn.Parameter], max_norm: float, total: Tensor) -> None:
    """Scale every gradient by max_norm / total when above it (each mesh group on its own)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in groups.values():
        device = group[0].grad.device
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(device))


def loss_ranks_sum(local: Tensor, mesh: Mesh) -> float:
    """The sum of `local` over the ranks that own a loss (one per data-parallel rank)."""
    value = local.detach().float().reshape(1) if mesh.owns_loss else torch.zeros(1)
    value = value.to(local.device)
    if math.prod(mesh.shape.values()) > 1:
        tdist.all_reduce(value)
    return value.item()


def global_loss(local_mean: Tensor, mesh: Mesh) -> float:
    """The step's mean loss: the loss-owning ranks' means, averaged over the data-parallel ranks."""
    result = loss_ranks_sum(local_mean, mesh) / mesh.dp_size
    return result if math.isfinite(result) else float("nan")
