"""Images as tokens: the shards, the constrained sampling, seeding, and `kiln train` end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.cli import main
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError
from kiln.image.captions import EOT
from kiln.image.dataset import ImageDataset, ScenesSpec, build_scenes
from kiln.image.sampler import load_image_model
from kiln.image.token_model import TokenImageModel, load_token_image_model, sample_codes
from kiln.image.tokens import IMAGE, TokenLayout, build_image_tokens, code_token, load_vqvae_run
from kiln.image.vqvae import to_unit
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.train.vqvae import VQVAERun, VQVAETrainConfig


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("imgtok")
    build_scenes(root / "scenes", ScenesSpec(size=32, train=48, val=8, heldout=8, seed=3))
    vq = VQVAETrainConfig.load(None, [
        f"data.dataset={root / 'scenes'}", f"run_dir={root / 'vq'}", "model.hidden=8",
        "model.res_blocks=0", "model.codebook_size=16", "model.code_dim=4",
        "train.batch_size=8", "train.max_steps=3", "train.eval_images=4", "train.restart_every=1",
    ])  # fmt: skip
    VQVAERun(vq).run(progress=False)
    build_image_tokens(root / "vq", root / "scenes", root / "toks", vocab_size=300, progress=False)
    return root / "scenes", root / "vq", root / "toks"


def test_shards_hold_each_caption_and_its_codes_exactly(shards) -> None:
    scenes, vq_run, toks = shards
    data, tokens = ImageDataset.open(scenes), Dataset.open(toks)
    tok = Tokenizer.load(toks / "tokenizer.json")
    layout = TokenLayout.from_dict(tok.metadata["image_tokens"], "test")
    vq, _ = load_vqvae_run(vq_run)
    assert layout.code_base == tok.special_tokens[code_token(0)] == layout.image_id + 1
    assert tok.n_vocab == layout.code_base + layout.codebook_size == tokens.vocab_size
    assert layout.image_id == layout.text_vocab and layout.eot_id == tokens.eot_id
    for split in ("train", "val", "heldout"):
        records, split_tokens = data.records(split), tokens.split(split)
        with torch.no_grad():
            expected = vq.encode(to_unit(torch.from_numpy(np.array(data.images(split))))).numpy()
        assert split_tokens.n_documents == len(records)
        codes_seen = set()
        for i, record in enumerate(records):
            doc = split_tokens.document(i)
            assert doc.shape == (layout.doc_tokens,) and doc[-1] == layout.eot_id
            caption, codes = layout.read_document(doc)
            assert tok.decode(caption) == record["caption"]  # caption text, recovered exactly
            assert np.array_equal(codes, expected[i])  # raster order: codes[row, col]
            codes_seen |= set(codes.flatten().tolist())
        assert len(codes_seen) > 1
    # Caption text that spells the image token is refused, never encoded as it.
    with pytest.raises(ValueError):
        tok.encode(f"a red ball {IMAGE}")


def test_documents_are_raster_order_and_refuse_long_captions() -> None:
    layout = TokenLayout(10, 10, 11, 4, 2, 9, 9, 8)
    doc = layout.document([3, 4], np.array([[0, 1], [2, 3]]))
    assert doc.tolist() == [3, 4, 10, 11, 12, 13, 14, 9, 9]
    with pytest.raises(KilnError, match="does not fit"):
        layout.document([1, 2, 3, 4, 5, 6], np.zeros((2, 2), dtype=np.int64))


def _lm(layout: TokenLayout, favour_text: bool = False) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=layout.code_base + layout.codebook_size,
                             block_size=64)  # fmt: skip
    model = Transformer(cfg).eval()
    if favour_text:  # every non-code id far likelier than any code: only the constraint holds
        bias = torch.zeros(cfg.vocab_size)
        bias[15] = 100.0  # a text id (below code_base) that is no code index either
        plain = model.logits
        model.logits = lambda h: plain(h) + bias  # type: ignore[method-assign]
    return model


def test_sampling_emits_only_code_ids_exactly_h_times_w() -> None:
    layout = TokenLayout(20, 20, 21, 8, 3, 16, 19, 12)
    model = _lm(layout, favour_text=True)
    prompts = [[5, 6, 7, layout.image_id], [8, layout.image_id]]  # different lengths: padded
    steps: list[int] = []
    codes = sample_codes(model, prompts, layout, seed=0, on_code=lambda i, c: steps.append(i))
    assert codes.shape == (2, 3, 3) and codes.dtype == torch.long
    assert ((codes >= 0) & (codes < layout.codebook_size)).all()
    assert steps == list(range(9))
    # Unconstrained, the same model would pick the non-code ids.
    with torch.no_grad():
        logits = model.logits(model.hidden(torch.tensor([prompts[0]]))[:, -1])
    assert int(logits.argmax()) == 15


def test_sampling_is_seeded_and_per_picture() -> None:
    layout = TokenLayout(20, 20, 21, 8, 3, 16, 19, 12)
    model = _lm(layout)
    prompt = [5, 6, layout.image_id]
    a = sample_codes(model, [prompt] * 3, layout, seed=4)
    assert torch.equal(a, sample_codes(model, [prompt] * 3, layout, seed=4))
    assert not torch.equal(a, sample_codes(model, [prompt] * 3, layout, seed=5))
    assert not torch.equal(a[0], a[1])  # each picture its own draw
    assert torch.equal(a[0], sample_codes(model, [prompt], layout, seed=4)[0])  # not on n
    greedy = sample_codes(model, [prompt] * 2, layout, seed=1, temperature=0)
    assert torch.equal(greedy[0], greedy[1])


def test_kiln_train_on_the_shards_then_sample_end_to_end(shards, tmp_path: Path, capsys) -> None:
    _, _, toks = shards
    config = Path(__file__).resolve().parents[2] / "configs" / "imgtok_32.toml"
    layout = TokenLayout.from_dict(
        Tokenizer.load(toks / "tokenizer.json").metadata["image_tokens"], "test"
    )
    run = tmp_path / "lm"
    code = main(["train", str(config), "--no-progress", "--set", f"data.dataset={toks}",
                 "--set", f"data.seq_len={layout.doc_tokens}", "--set", f"logging.run_dir={run}",
                 "--set", "train.max_steps=3", "--set", "train.dtype=fp32",
                 "--set", f"batch.global_tokens={4 * layout.doc_tokens}",
                 "--set", "batch.micro_batch=4", "--set", "eval.every=3", "--set", "eval.batches=1",
                 "--set", "model.n_layer=1", "--set", "model.n_embd=32"])  # fmt: skip
    assert code == 0
    model = load_image_model(run)
    assert isinstance(model, TokenImageModel) and model.size == 32
    previews: list[int] = []
    pictures = model.sample(["a red ball", "a blue boat on water"], seed=2,
                            on_step=lambda i, p: previews.append(p.shape[0]))  # fmt: skip
    assert previews == [2] * model.diffusion.sample_steps == [2] * layout.codes_per_image
    assert pictures.shape == (2, 3, 32, 32) and 0 <= pictures.min() <= pictures.max() <= 1
    again = load_token_image_model(run).sample(["a red ball"], seed=2)
    assert torch.allclose(pictures[0], again[0])
    with pytest.raises(KilnError, match="control-token"):
        model.sample([f"a {EOT}"], seed=0)
    with pytest.raises(KilnError, match="guidance"):
        model.sample(["a red ball"], seed=0, guidance=3.0)
    out = tmp_path / "grid.png"
    assert main(["image", "sample", str(run), "--prompt", "a red ball", "-n", "2",
                 "--out", str(out), "--seed", "1"]) == 0  # fmt: skip
    assert out.stat().st_size > 0
    assert main(["image", "sample", str(run), "--prompt", "a red ball", "--out", str(out)]) != 0
    assert "already exists" in capsys.readouterr().err


def test_tokens_command_refuses_to_clobber_and_names_a_size_mismatch(
    shards, tmp_path, capsys
) -> None:
    scenes, vq_run, toks = shards
    assert main(["image", "tokens", str(vq_run), str(scenes), "--out", str(toks), "--quiet"]) != 0
    assert "already exists" in capsys.readouterr().err
    build_scenes(tmp_path / "s64", ScenesSpec(size=64, train=8, val=2, heldout=2, seed=1))
    assert main(["image", "tokens", str(vq_run), str(tmp_path / "s64"), "--out",
                 str(tmp_path / "t"), "--quiet"]) != 0  # fmt: skip
    assert "64×64" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
