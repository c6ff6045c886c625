"""`kiln data synth generate|rewrite` and `kiln data annotate` on a tiny `kiln demo` model: the
output is a pipeline source with each document's provenance, a killed run resumes to the same
bytes, LM scores are the digits' expected value, and bad configs are one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.data.pipeline.records import read_records
from kiln.errors import KilnError
from kiln.io import sha256_file
from kiln.posttrain.synth import run
from tests.fixtures import EOT, single_torch_thread

ROOT = Path(__file__).resolve().parents[3]
# The smallest demo there is (as tests/test_loading.py's): a 512-token BPE, 2 steps.
DEMO_ARGS = ["--steps", "2", "--vocab-size", "512", "--story-tokens", "8",
             "--set", "batch.global_tokens=4096", "--set", "batch.micro_batch=16",
             "--set", "eval.batches=1", "--set", "train.dtype=fp32"]  # fmt: skip
TEMPLATE = "Once upon a time, there was a {adjective} {noun}. Every day it liked to {verb}."

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `kiln demo` folder: the model every test here writes and scores with."""
    out = tmp_path_factory.mktemp("demo") / "demo-20260101-000000"
    assert main(["demo", "--out", str(out), *DEMO_ARGS]) == 0
    return out


def generate_toml(folder: Path, demo: Path, documents: int = 6, extra: str = "") -> Path:
    """A generate config of `documents` short stories in parts of 2."""
    path = folder / "gen.toml"
    path.write_text(
        f"""output = "gen"
documents = {documents}
template = "{TEMPLATE}"
keep_prompt = true
{extra}
[model]
path = "{demo}"
batch_size = 2
[sampling]
max_tokens = 6
temperature = 0.9
""",
        encoding="utf-8",
    )
    return path


def lines(path: Path) -> list[dict]:
    """The JSON records of a JSONL file."""
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_generate_writes_seeded_stories_with_their_provenance(demo: Path, tmp_path: Path) -> None:
    manifest = run.generate(generate_toml(tmp_path, demo), progress=False)
    docs = lines(tmp_path / "gen" / "documents.jsonl")
    assert manifest["documents"] == len(docs) == 6
    assert len({d["id"] for d in docs}) == 6
    weights = demo / "train" / "checkpoints" / "step_2" / "model.safetensors"
    for d in docs:
        p = d["provenance"]
        assert p["model_sha256"] == sha256_file(weights)
        assert p["method"] == "generate" and p["sampling"]["temperature"] == 0.9
        drawn = p["drawn"]
        assert p["prompt"] == TEMPLATE.format(**drawn)
        assert d["text"].startswith(p["prompt"])  # keep_prompt: the story includes its start
    # the words differ between documents (random draws), the seeds too
    assert len({d["provenance"]["prompt"] for d in docs}) > 1
    assert len({d["provenance"]["seed"] for d in docs}) == 6
    assert (tmp_path / "gen" / "manifest.json").is_file()
    assert not (tmp_path / "gen" / "parts").exists()


def test_generate_refuses_another_config_in_its_folder_without_force(
    demo: Path, tmp_path: Path
) -> None:
    config = generate_toml(tmp_path, demo, documents=2)
    run.generate(config, progress=False)
    with pytest.raises(KilnError, match=r"made by another config.*--force"):
        run.generate(config, ("seed=1",), progress=False)
    again = run.generate(config, ("seed=1",), force=True, progress=False)
    assert again["documents"] == 2


def _kiln(args: list[str], cwd: Path, kill_at: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_TEST_KILL_AT": kill_at}
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def test_a_killed_generate_resumes_without_duplicating_or_losing_a_document(
    demo: Path, tmp_path: Path
) -> None:
    config = generate_toml(tmp_path, demo, documents=7)
    args = ["data", "synth", "generate", str(config), "--quiet"]
    straight = _kiln([*args, "--out", "straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr
    killed = _kiln([*args, "--out", "cut"], tmp_path, kill_at="synth.part@2")
    assert killed.returncode == -9  # SIGKILL after its second part
    parts = sorted(p.name for p in (tmp_path / "cut" / "parts").iterdir())
    assert parts == ["000000.jsonl", "000001.jsonl"]
    assert not (tmp_path / "cut" / "documents.jsonl").exists()
    resumed = _kiln([*args, "--out", "cut"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed: 2 part(s) found done, 2 made now" in resumed.stdout
    a = (tmp_path / "straight" / "documents.jsonl").read_bytes()
    b = (tmp_path / "cut" / "documents.jsonl").read_bytes()
    assert a == b  # seeded, batch-invariant: the resumed run wrote what an unbroken one did
    ids = [d["id"] for d in lines(tmp_path / "cut" / "documents.jsonl")]
    assert len(ids) == len(set(ids)) == 7


def test_rewrite_paraphrases_each_input_and_names_it(demo: Path, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(
        f"The cat sat on the mat.\n{EOT}\nA dog ran in the park.\n{EOT}\nBirds sing.\n",
        encoding="utf-8",
    )
    (tmp_path / "rw.toml").write_text(
        f"""output = "rw"
style = "qa"
max_input_tokens = 4
[model]
path = "{demo}"
batch_size = 2
[sampling]
max_tokens = 5
[[sources]]
name = "web"
paths = ["in.txt"]
""",
        encoding="utf-8",
    )
    run.rewrite(tmp_path / "rw.toml", progress=False)
    docs = lines(tmp_path / "rw" / "documents.jsonl")
    assert [d["provenance"]["input"]["ordinal"] for d in docs] == [0, 1, 2]
    first = docs[0]["provenance"]
    assert first["style"] == "qa" and first["method"] == "rewrite"
    assert first["prompt"].startswith("Convert the following text into a set of questions")
    assert "The cat sat" in first["prompt"] and "on the mat" not in first["prompt"]  # cut to 4
    assert len(first["input"]["sha256"]) == 64


def test_synthetic_documents_carry_provenance_through_the_pipeline(
    demo: Path, tmp_path: Path, shared_data: Path
) -> None:
    run.generate(generate_toml(tmp_path, demo, documents=4), progress=False)
    (tmp_path / "real.txt").write_text(
        f"Tom had a red ball. He liked to play with it in the sun.\n{EOT}\n"
        f"Sue saw a big dog. The dog was kind and she gave it a bone.\n",
        encoding="utf-8",
    )
    # The synthetic file twice: exact dedup removes the second copy of each document, and the
    # removal names where the document came from.
    (tmp_path / "p.toml").write_text(
        f"""[[sources]]
name = "real"
paths = ["real.txt"]
[[sources]]
name = "synth"
paths = ["gen/documents.jsonl"]
id_field = "id"
[[sources]]
name = "synth_again"
paths = ["gen/documents.jsonl"]
[language]
enabled = false
[quality.gopher_quality]
enabled = false
[quality.gopher_repetition]
enabled = false
[quality.c4]
enabled = false
[quality.fineweb]
enabled = false
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{demo / "tokenizer.json"}"
""",
        encoding="utf-8",
    )
    assert main(["data", "run", str(tmp_path / "p.toml"), "--out", str(tmp_path / "ds"),
                 "--workers", "1", "--quiet"]) == 0  # fmt: skip
    maps = [r for p in sorted((tmp_path / "ds").glob("train_*.docs.jsonl.zst"))
            for r in read_records(p)]  # fmt: skip
    synthetic = [r for r in maps if r["source"] == "synth"]
    assert synthetic and all(r["provenance"]["method"] == "generate" for r in synthetic)
    assert all("provenance" not in r for r in maps if r["source"] == "real")
    removed = list(read_records(tmp_path / "ds" / "pipeline" / "removed.jsonl.zst"))
    dupes = [r for r in removed if r["source"] == "synth_again"]
    assert len(dupes) == 4
    assert all(r["provenance"]["model_sha256"] for r in dupes)


def test_annotate_scores_are_the_expected_digit_and_train_the_classifier(
    demo: Path, tmp_path: Path
) -> None:
    stories = "\n".join(f"Story {i}: the {w} cat ran home.\n{EOT}" for i, w in
                        enumerate(["big", "red", "shy", "old", "sad", "wet"]))  # fmt: skip
    (tmp_path / "docs.txt").write_text(stories, encoding="utf-8")
    (tmp_path / "ann.toml").write_text(
        f"""output = "ann"
rubric = "Rate it 0 to 5. {{text}} Score:"
[model]
path = "{demo}"
batch_size = 4
[[sources]]
name = "docs"
paths = ["docs.txt"]
""",
        encoding="utf-8",
    )
    manifest = run.annotate(tmp_path / "ann.toml", progress=False)
    docs = lines(tmp_path / "ann" / "documents.jsonl")
    assert manifest["documents"] == len(docs) == 6
    # The score is the expectation of 0..5 under the next token's digit probabilities.
    from kiln.loading import load_model

    loaded = load_model(demo, device="cpu", dtype="fp32")
    tok = loaded.tokenizer
    prompt = [loaded.eot_id, *tok.encode(f"Rate it 0 to 5. {docs[0]['text']} Score:")]
    with torch.no_grad():
        out = loaded.model(torch.tensor([prompt]))
    logits = out.logits if hasattr(out, "logits") else out
    logp = logits[0, -1].float().log_softmax(-1)
    per_digit = []
    for d in "012345":
        ids = sorted({t[0] for t in (tok.encode(d), tok.encode(" " + d)) if len(t) == 1})
        per_digit.append(torch.logsumexp(logp[ids], 0))
    probs = torch.stack(per_digit).softmax(0)
    assert docs[0]["probs"] == pytest.approx(probs.tolist(), abs=1e-4)
    assert docs[0]["score"] == pytest.approx(float((probs * torch.arange(6.0)).sum()), abs=1e-4)
    assert docs[0]["provenance"]["rubric"] == "Rate it 0 to 5. {text} Score:"


def test_the_classifier_learns_from_annotations_and_reports_agreement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Planted annotations: documents about planets score high, documents about shopping low.
    good = ["planets orbit the sun and gravity holds moons", "the earth turns and planets move"]
    bad = ["buy cheap shoes now click here", "sale sale best price shop today"]
    with open(tmp_path / "ann.jsonl", "w", encoding="utf-8") as f:
        for i in range(200):
            text, score = (good[i % 2], 4.0 + (i % 3) / 3) if i % 4 < 2 else (bad[i % 2], i % 3 / 2)
            f.write(json.dumps({"text": f"{text} {i}", "score": score}) + "\n")
    (tmp_path / "cls.toml").write_text(
        """output = "cls.npz"
held_out = 0.25
buckets = 4096
[[annotations]]
name = "edu"
paths = ["ann.jsonl"]
""",
        encoding="utf-8",
    )
    assert main(["data", "classifier", "train", str(tmp_path / "cls.toml")]) == 0
    out = capsys.readouterr().out
    assert "agreement with the annotations on the held-out documents: accuracy 100.0%" in out
    from kiln.data.pipeline.filter.quality_classifier import LinearClassifier

    info = LinearClassifier.load(tmp_path / "cls.npz").info
    assert info["held_out"]["spearman"] > 0.7
    assert info["annotations"] == ["edu"] and info["positive_score"] == 3.0
    from kiln.data.pipeline.report import _models

    html = _models({"classifier": {**info, "model": "cls.npz", "threshold": 0.5}})
    assert "LM annotations (edu)" in html and "Spearman" in html


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[model]\nbatch_size = 2\n", r"x\.toml: model\.path: give the model"),
        ("[model]\npath = 'nowhere'\n", r"x\.toml: model\.path = '.*nowhere': no such model"),
        ("[model]\npath = 'DEMO'\ntokenizer = 'no.json'\n",
         r"x\.toml: model\.tokenizer = '.*no\.json': no such file"),
        ("documents = 0\n[model]\npath = 'DEMO'\n", r"x\.toml: documents = 0: expected >= 1"),
        ("[model]\npath = 'DEMO'\n[sampling]\ntop_p = 2.0\n", r"x\.toml: sampling\.top_p = 2\.0"),
    ],
)  # fmt: skip
def test_bad_generate_configs_are_one_line_naming_the_field_and_file(
    demo: Path, tmp_path: Path, toml: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "x.toml"
    config.write_text(f"output = 'o'\n{toml}".replace("DEMO", str(demo)), encoding="utf-8")
    assert main(["data", "synth", "generate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_a_model_whose_tokenizer_cannot_be_found_is_named(demo: Path, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo / "train", model)  # the run folder alone: its tokenizer is elsewhere
    (demo / "tokenizer.json").rename(tmp_path / "hidden.json")
    try:
        config = generate_toml(tmp_path, model)
        with pytest.raises(KilnError, match=r"gen\.toml: model\.path: .*tokenizer"):
            run.generate(config, progress=False)
    finally:
        (tmp_path / "hidden.json").rename(demo / "tokenizer.json")


def test_a_mixture_share_out_of_range_names_the_source_and_file(tmp_path: Path) -> None:
    from kiln.data.pipeline.config import load_pipeline_config

    (tmp_path / "p.toml").write_text(
        "[[sources]]\nname = 'synth'\npaths = ['a.jsonl']\nshare = 1.5\n"
        "[tokenize]\ntokenizer = 't.json'\n",
        encoding="utf-8",
    )
    with pytest.raises(KilnError, match=r"p\.toml: sources\['synth'\]\.share = 1\.5"):
        load_pipeline_config(tmp_path / "p.toml")


def test_spearman_ranks_ties_by_their_mean_rank() -> None:
    import numpy as np

    from kiln.data.pipeline.filter.model_training import spearman

    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # ties: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): Pearson of the ranks
    assert spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0])) == (
        pytest.approx(0.9486833, abs=1e-6)
    )
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 50).astype(float), rng.normal(size=50)
    assert spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic, abs=1e-12)
