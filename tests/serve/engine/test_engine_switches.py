"""The engine's paged-cache decoding under issue #21's switches equals kiln.model.generate."""

from __future__ import annotations

import pytest

from kiln.model.generate import generate
from kiln.serve.engine.sampling import SamplingParams
from tests.model.helpers import build, gpt2_small, llama_small
from tests.serve.conftest import random_prompts

SWITCHED = {
    "parallel-fused-partial-rope": llama_small(parallel_block=True, rotary_fraction=0.5),
    "sandwich-geglu-embed-scale": llama_small(
        norm_placement="sandwich", mlp="geglu", embed_scale=True
    ),
    "mup-attention-scale": llama_small(mup_base_width=32),
    "post-relu2-nope": llama_small(norm_placement="post", mlp="relu2", pos_emb="none"),
    "sinusoidal-no-norm-scale": gpt2_small(pos_emb="sinusoidal", norm_scale=False),
}


@pytest.mark.parametrize("cfg", SWITCHED.values(), ids=SWITCHED.keys())
def test_engine_greedy_equals_generate(cfg, make_engine) -> None:
    model = build(cfg)
    prompts = random_prompts(4, 1, 30, 300)
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=24)
    out = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    expected = [generate(model, [p], 10, temperature=0.0)[0] for p in prompts]
    assert [c[0].token_ids for c in out] == expected
