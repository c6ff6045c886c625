"""A model's trainable parameters by role (hidden matrices, head, embeddings, vectors): the
split the optimizer's groups and µP's multipliers both follow."""

from __future__ import annotations

from torch import nn

__all__ = ["HEAD_PREFIX", "split_parameters"]

HEAD_PREFIX = "lm_head."  # the output layer of kiln.model.Transformer


def split_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by role: 'hidden' 2-D matrices, 'head', 'embedding', 'vector' (1-D).

    A tied head is the embedding's own Parameter, so it is listed once, as an embedding.
    """
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    roles: dict[str, list[tuple[str, nn.Parameter]]] = {
        "hidden": [], "head": [], "embedding": [], "vector": []
    }  # fmt: skip
    for name, p in model.named_parameters():  # shared Parameters appear once
        if not p.requires_grad:
            continue
        if id(p) in embedding_ids:
            roles["embedding"].append((name, p))
        elif p.dim() < 2:
            roles["vector"].append((name, p))
        elif name.startswith(HEAD_PREFIX):
            roles["head"].append((name, p))
        else:
            roles["hidden"].append((name, p))
    return roles
