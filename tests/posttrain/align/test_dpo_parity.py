"""kiln's DPO and IPO losses and gradients equal trl's DPOTrainer on the same model, reference
and pairs (kiln's model exported to transformers; the batch built by hand, right-padded)."""

from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.model.hf import state_dict_to_hf, to_hf
from kiln.model.transformer import Transformer
from kiln.posttrain.align.dpo import DPOConfig, TokenPair, preference_loss
from kiln.posttrain.align.dpo_loss import DPOOutput, dpo_loss
from tests.fixtures import single_torch_thread

trl = pytest.importorskip("trl", reason="trl (a dev dependency) is the DPO reference")
datasets = pytest.importorskip("datasets", reason="datasets comes with trl")

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

V = 64
PAIRS = [  # (prompt, chosen, rejected) as token ids
    ([5, 6, 7], [10, 11, 2], [13, 2]),
    ([8, 9], [12, 2], [14, 15, 16, 2]),
    ([20, 21, 22, 23], [30, 31, 32, 33, 2], [40, 2]),
]


def batch() -> dict[str, torch.Tensor]:
    """trl's layout: chosen rows, then rejected rows; right padding; completion mask."""
    rows = [(p, c) for p, c, _ in PAIRS] + [(p, r) for p, _, r in PAIRS]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.ones(len(rows), width, dtype=torch.long)  # pad id 1
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        comp[i, len(p) : n] = 1
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp}


def make_models() -> tuple[Transformer, Transformer]:
    cfg = ModelConfig.preset("tiny", vocab_size=V, vocab_multiple=1, block_size=32)
    torch.manual_seed(0)
    policy = Transformer(cfg)
    ref = Transformer(cfg)
    return policy, ref


def trl_trainer(
    policy: Transformer,
    ref: Transformer,
    loss_type: str | list[str],
    beta: float,
    loss_weights: list[float] | None = None,
) -> trl.DPOTrainer:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
        pad_token="t1",
        eos_token="t2",
    )
    ds = datasets.Dataset.from_dict({"prompt": ["t5"], "chosen": ["t6"], "rejected": ["t7"]})
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(), beta=beta, report_to=[], loss_weights=loss_weights,
        loss_type=[loss_type] if isinstance(loss_type, str) else loss_type,
        use_cpu=True, bf16=False, per_device_train_batch_size=len(PAIRS),
    )  # fmt: skip
    return trl.DPOTrainer(
        model=to_hf(policy).train(), ref_model=to_hf(ref), args=args, train_dataset=ds,
        processing_class=tok,
    )  # fmt: skip


def kiln_loss(
    policy: Transformer, ref: Transformer, loss_type: str, beta: float, rpo_alpha: float = 0.0
) -> DPOOutput:
    pairs = [TokenPair(p, c, r) for p, c, r in PAIRS]
    cfg = DPOConfig(beta=beta, loss_type=loss_type, rpo_alpha=rpo_alpha)
    return preference_loss(policy, ref, pairs, cfg)


@pytest.mark.kernels
def test_the_rpo_term_equals_trl_sigmoid_plus_sft() -> None:
    # trl 1.16 has no rpo_alpha: RPO is loss_type ["sigmoid", "sft"] weighted [1, alpha]
    beta, alpha = 0.3, 0.7
    policy, ref = make_models()
    trainer = trl_trainer(policy, ref, ["sigmoid", "sft"], beta, [1.0, alpha])
    trl_value = trainer.compute_loss(trainer.model, batch())
    policy.train()
    with_rpo = kiln_loss(policy, ref, "sigmoid", beta, rpo_alpha=alpha)
    plain = kiln_loss(policy, ref, "sigmoid", beta)
    assert with_rpo.loss.item() == pytest.approx(trl_value.item(), rel=1e-5, abs=1e-6)
    assert with_rpo.loss.item() == pytest.approx(plain.loss.item() + alpha * plain.nll.item())
    assert with_rpo.loss.item() != pytest.approx(plain.loss.item(), rel=1e-3)


def test_the_rpo_term_by_hand() -> None:
    # chosen log-probs summed -3 (2 tokens) and -1 (2 tokens): NLL per token = 4 / 4 = 1;
    # margins 0 (policy = reference): DPO loss log 2; with α 0.5: log 2 + 0.5
    z = torch.zeros(2)
    chosen = torch.tensor([-3.0, -1.0])
    lengths = torch.tensor([2.0, 2.0])
    out = dpo_loss(chosen, z, chosen, z, 0.1, "sigmoid", lengths, lengths, rpo_alpha=0.5)
    assert out.nll.item() == pytest.approx(1.0)
    assert out.loss.item() == pytest.approx(math.log(2) + 0.5)


@pytest.mark.kernels
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_gradients_equal_trl(loss_type: str) -> None:
    beta = 0.3
    policy, ref = make_models()
    b = batch()
    trainer = trl_trainer(policy, ref, loss_type, beta)
    trl_value = trainer.compute_loss(trainer.model, b)
    trl_value.backward()
    trl_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}

    policy.train()
    out = kiln_loss(policy, ref, loss_type, beta)
    out.loss.backward()
    grads = copy.deepcopy(policy)
    with torch.no_grad():
        for p, g in zip(grads.parameters(), policy.parameters(), strict=True):
            p.copy_(g.grad)
    kiln_grads = state_dict_to_hf(grads)

    assert out.loss.item() == pytest.approx(trl_value.item(), rel=1e-5, abs=1e-6)
    assert out.loss.item() > 0
    compared = 0
    for name, g in trl_grads.items():
        if name in kiln_grads:
            torch.testing.assert_close(kiln_grads[name], g, rtol=1e-4, atol=1e-6)
            compared += 1
    assert compared >= 10  # every projection and norm of the two blocks, and the embedding


def test_trained_toward_chosen_the_margin_grows() -> None:
    policy, ref = make_models()
    policy.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    first = kiln_loss(policy, ref, "sigmoid", 0.5)
    assert first.margins.abs().max().item() == pytest.approx(0.0, abs=1e-5)  # policy == reference
    for _ in range(5):
        opt.zero_grad()
        out = kiln_loss(policy, ref, "sigmoid", 0.5)
        out.loss.backward()
        opt.step()
    assert out.loss.item() < first.loss.item()
    assert out.accuracy == 1.0


def test_bad_settings_are_named() -> None:
    z = torch.zeros(2)
    with pytest.raises(KilnError, match="beta must be > 0"):
        dpo_loss(z, z, z, z, beta=0)
    with pytest.raises(KilnError, match="loss_type must be one of sigmoid, ipo"):
        dpo_loss(z, z, z, z, beta=0.1, loss_type="hinge")
    with pytest.raises(KilnError, match="ipo loss needs chosen_lengths"):
        dpo_loss(z, z, z, z, beta=0.1, loss_type="ipo")
