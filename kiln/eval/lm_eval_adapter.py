"""A `kiln` model for lm-evaluation-harness, so its tasks run on kiln checkpoints.

Importing this module registers the class under the name "kiln":

    import kiln.eval.lm_eval_adapter  # noqa: F401
    lm_eval.simple_evaluate(model="kiln", model_args="pretrained=runs/demo", tasks=[...])

or from the command line: `kiln eval runs/demo --lm-eval-tasks hellaswag`. Requests are scored
by the same code as kiln's own tasks (`kiln.eval.scoring`), so the numbers agree.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kiln.errors import KilnError
from kiln.eval.scoring import Scorer, encode_pair
from kiln.loading import LoadedModel, load_model

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:
    raise KilnError(
        "lm-evaluation-harness is not installed; install kiln's eval extra: "
        "pip install 'kiln[eval]'"
    ) from None


@register_model("kiln")
class KilnLM(LM):
    """lm-eval's LM interface over a kiln model: loglikelihood, rolling, greedy generation."""

    def __init__(
        self,
        pretrained: str | None = None,
        tokenizer: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str = 16,
        max_gen_toks: int = 256,
        progress: bool = True,
        loaded: LoadedModel | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; kiln takes a fixed batch size
    ) -> None:
        super().__init__()
        batch_size = 16 if str(batch_size).startswith("auto") else batch_size
        if loaded is None:
            if pretrained is None:
                raise KilnError("the kiln lm-eval model needs pretrained=MODEL_DIR")
            loaded = load_model(pretrained, tokenizer, str(device), dtype)
        self.loaded = loaded
        self.tok = loaded.tokenizer
        self.eot_id = loaded.eot_id
        self.max_gen_toks = int(max_gen_toks)
        self.scorer = Scorer(
            loaded.model, int(batch_size), _flag(progress), autocast_dtype=loaded.autocast_dtype
        )
        self._device = self.scorer.device
        self._engine: Any = None  # the serving engine, built at the first generation request

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(log-prob of the continuation, whether greedy decoding yields it) per request."""
        pairs = [encode_pair(self.tok, c, x, self.eot_id) for c, x in (r.args for r in requests)]
        scored = self.scorer.score_requests(pairs, desc="lm-eval loglikelihood")
        out = []
        for req, s in zip(requests, scored, strict=True):
            answer = (s.logprob, s.is_greedy)
            self.cache_hook.add_partial("loglikelihood", req.args, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Each string's total log-prob after end-of-text, every token scored once (windows of
        the block size, the last one reaching back a full block, as lm-eval specifies)."""
        if self.eot_id is None:
            raise KilnError("loglikelihood_rolling needs an end-of-text token to start from")
        docs = [[self.eot_id, *self.tok.encode_ordinary(req.args[0])] for req in requests]
        scored = self.scorer.score_documents(docs, desc="lm-eval rolling")
        out = []
        for req, s in zip(requests, scored, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, s.logprob)
            out.append(s.logprob)
        return out

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy continuations, cut at the first of each request's `until` strings.

        All requests run together on the serving engine (continuous batching); each stops at
        its own `until` strings, its own length and the end-of-text token.
        """
        from kiln.serve.engine import Engine

        if self._engine is None:
            self._engine = Engine.from_loaded(self.loaded)
        work = [self._request(*req.args) for req in requests]  # all checked before any runs
        handles = [self._engine.submit(prompt, params) for prompt, params in work]
        out = []
        for req, handle in zip(requests, handles, strict=True):
            (done,) = handle.result()
            if done.finish_reason == "error":
                raise KilnError(f"generation failed: {done.error}")
            self.cache_hook.add_partial("generate_until", req.args, done.text)
            out.append(done.text)
        return out

    def _request(self, context: str, gen_kwargs: dict[str, Any]) -> tuple[list[int], Any]:
        """Prompt ids and sampling parameters of one greedy generation request."""
        from kiln.serve.engine import SamplingParams

        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0)) > 0:
            raise KilnError("the kiln lm-eval model generates greedily only (do_sample=False)")
        T = self.scorer.block_size
        max_new = min(max_new, T - 1)
        prompt = self.tok.encode_ordinary(context)[-(T - max_new) :]
        if not prompt:
            if self.eot_id is None:
                raise KilnError("an empty prompt needs an end-of-text token to start from")
            prompt = [self.eot_id]
        params = SamplingParams(
            max_tokens=max_new, temperature=0.0, stop=tuple(s for s in until if s)
        )
        return prompt, params


def _flag(value: bool | str) -> bool:
    """A boolean from model_args text ("false", "0") or a bool."""
    return value if isinstance(value, bool) else str(value).lower() not in ("false", "0", "no")


def run_lm_eval(
    loaded: LoadedModel,
    tasks: Sequence[str],
    include_path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Run lm-eval tasks on a loaded kiln model; {task: {metric: value}} as lm-eval names them.

    With `include_path`, the task index is built from that directory alone when it defines every
    task asked for (fast, and nothing of lm-eval's own task list is read).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names = [t.strip() for t in tasks if t.strip()]
    manager = None
    if include_path is not None:
        manager = TaskManager(include_path=os.fspath(include_path), include_defaults=False)
        if not set(names) <= set(manager.all_tasks):
            manager = TaskManager(include_path=os.fspath(include_path))
    else:
        manager = TaskManager()
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise KilnError(f"unknown lm-eval task(s): {', '.join(unknown)} (see `lm_eval ls tasks`)")
    lm = KilnLM(loaded=loaded, batch_size=batch_size, progress=progress)
    out = simple_evaluate(
        model=lm, tasks=names, limit=limit, task_manager=manager, bootstrap_iters=0,
        log_samples=False,
    )  # fmt: skip
    if out is None:  # lm-eval returns None on ranks other than 0
        return {}
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        for task, metrics in out["results"].items()
    }
