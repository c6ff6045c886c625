"""The `kiln` lm-evaluation-harness model: local task YAMLs, no network, kiln's own numbers."""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.eval.lm import bits_per_byte
from kiln.eval.multiple_choice import evaluate_task
from kiln.eval.scoring import Scorer, encode_pair
from kiln.eval.tasks import load_task
from kiln.loading import LoadedModel, load_model
from kiln.model.generate import generate
from kiln.model.hf import save_hf_dir
from kiln.tokenizer import Tokenizer
from kiln.train.export import write_hf_tokenizer

from .conftest import EOT, random_tiny

pytest.importorskip("lm_eval")

MC_YAML = """task: kiln_copa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: query
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""

ROLLING_YAML = """task: kiln_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
"""


@pytest.fixture
def loaded(tmp_path: Path, tok: Tokenizer) -> LoadedModel:
    """A random tiny model loaded from an HF directory, as `kiln eval` loads one."""
    save_hf_dir(random_tiny(seed=3), tmp_path / "model", eos_token_id=tok.special_tokens[EOT])
    write_hf_tokenizer(tok, tmp_path / "model", EOT, 128)
    return load_model(tmp_path / "model", device="cpu", dtype="fp32")


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network at all, and every Hugging Face cache under tmp_path."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    if "datasets" in sys.modules:  # read at import: set what an earlier import already read
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def local_tasks(shared_data: Path, tmp_path: Path) -> Path:
    """Two lm-eval task YAMLs on local copies of a few lines of the shared files."""
    lines = (shared_data / "eval" / "copa.jsonl").read_text().splitlines()[:12]
    (tmp_path / "copa.jsonl").write_text("\n".join(lines) + "\n")
    lambada = (shared_data / "eval" / "lambada_openai.jsonl").read_text().splitlines()[:3]
    texts = [json.loads(line)["context"] for line in lambada]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "copa.yaml").write_text(MC_YAML.format(path=tmp_path / "copa.jsonl"))
    (tasks / "bpb.yaml").write_text(ROLLING_YAML.format(path=tmp_path / "docs.jsonl"))
    return tasks


def test_local_lm_eval_tasks_from_the_command_line_agree_with_kiln(
    offline: None, loaded: LoadedModel, local_tasks: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "r.json"
    args = ["--lm-eval-tasks", "kiln_copa,kiln_bpb", "--lm-eval-include", str(local_tasks)]
    args += ["--dtype", "fp32"]  # as the `loaded` fixture, whatever this CPU's auto choice
    code = main(["eval", str(tmp_path / "model"), *args, "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "lm-eval kiln_copa: acc,none" in capsys.readouterr().out
    results = json.loads(out.read_text())["lm_eval"]

    scorer = Scorer(loaded.model, 4, progress=False)
    ours = evaluate_task(load_task("copa", tmp_path), scorer, loaded.tokenizer, loaded.eot_id)
    assert results["kiln_copa"]["acc,none"] == pytest.approx(ours.metrics["acc"])
    # lm-eval's acc_norm divides by characters, kiln's by bytes: the same on ASCII text.
    assert results["kiln_copa"]["acc_norm,none"] == pytest.approx(ours.metrics["acc_norm"])
    bpb = bits_per_byte(scorer, loaded.tokenizer, tmp_path / "docs.jsonl", loaded.eot_id)
    assert results["kiln_bpb"]["bits_per_byte,none"] == pytest.approx(bpb.bits_per_byte, rel=1e-6)
    assert results["kiln_bpb"]["byte_perplexity,none"] == pytest.approx(
        2**bpb.bits_per_byte, rel=1e-6
    )
    assert not (tmp_path / "hf" / "hub").exists()  # nothing was fetched from the Hub


def test_the_kiln_model_is_registered_with_lm_eval(
    offline: None, loaded: LoadedModel, local_tasks: Path, tmp_path: Path
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from kiln.eval.lm_eval_adapter import KilnLM

    assert get_model("kiln") is KilnLM
    out = simple_evaluate(
        model="kiln", model_args=f"pretrained={tmp_path / 'model'},progress=false",
        tasks=["kiln_copa"], batch_size="auto", bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(local_tasks), include_defaults=False),
    )  # fmt: skip
    scorer = Scorer(loaded.model, 4, progress=False)
    ours = evaluate_task(load_task("copa", tmp_path), scorer, loaded.tokenizer, loaded.eot_id)
    assert out["results"]["kiln_copa"]["acc,none"] == pytest.approx(ours.metrics["acc"])


def test_a_missing_lm_eval_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # import fails as if absent
    monkeypatch.delitem(sys.modules, "kiln.eval.lm_eval_adapter", raising=False)
    with pytest.raises(KilnError, match=r"pip install 'kiln\[eval\]'"):
        import kiln.eval.lm_eval_adapter  # noqa: F401


def test_rolling_and_generation_requests(offline: None, loaded: LoadedModel) -> None:
    from lm_eval.api.instance import Instance

    from kiln.eval.lm_eval_adapter import KilnLM

    lm = KilnLM(loaded=loaded, batch_size=2, max_gen_toks=12, progress=False)
    tok, model = loaded.tokenizer, loaded.model

    def request(kind: str, args: tuple) -> Instance:
        return Instance(request_type=kind, doc={}, arguments=args, idx=0)

    text = "The little dog ran to the park. " * 10  # longer than one 128-token block
    (rolling,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    (expected,) = Scorer(model, progress=False).score_documents([[399, *tok.encode_ordinary(text)]])
    assert rolling == pytest.approx(expected.logprob, abs=1e-4)
    assert expected.n_tokens == len(tok.encode_ordinary(text)) > 128

    (pair,) = lm.loglikelihood([request("loglikelihood", ("The dog", " ran home"))])
    (direct,) = Scorer(model, progress=False).score_requests(
        [encode_pair(tok, "The dog", " ran home", 399)]
    )
    assert pair[0] == pytest.approx(direct.logprob, abs=1e-5) and pair[1] is direct.is_greedy
    assert math.isfinite(pair[0]) and pair[0] < 0

    prompt = "Once upon a time"
    ids = generate(model, [tok.encode_ordinary(prompt)], 12, temperature=0.0, stop_tokens=[399])[0]
    full = tok.decode(ids)
    stop = full[len(full) // 2 :][:2] or "zzz"  # a stop string from the greedy text itself
    (cut,) = lm.generate_until(
        [request("generate_until", (prompt, {"until": [stop], "max_gen_toks": 12}))]
    )
    assert cut == full[: full.index(stop)]
    (whole,) = lm.generate_until([request("generate_until", (prompt, {"until": ["\u2603"]}))])
    assert whole == full
    with pytest.raises(KilnError, match="greedily only"):
        lm.generate_until(
            [request("generate_until", (prompt, {"do_sample": True, "temperature": 1.0}))]
        )
