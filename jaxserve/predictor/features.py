"""Final-norm hidden states of given positions of the served model, for
training and for the simulator's prediction cache.

Positions past the model's window ``W`` are read from a
left-truncated window ``token_ids[end - W:end]`` (documented approximation:
the engine would see the whole context).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flax import nnx

from jaxserve.model_source import load_tokenizer, resolve_model
from jaxserve.predictor.checkpoint import ModelIdentity, model_identity
from jaxserve.weights import load_model


@dataclass
class ServedModel:
    """A loaded model, its tokenizer and identity (what a probe is trained on)."""

    name: str
    model_dir: Path
    model: nnx.Module
    config: object
    tokenizer: object
    identity: ModelIdentity
    window: int        # tokens one forward may hold (the model's max positions, capped)


def load_served_model(model: str, max_window: int = 4096) -> ServedModel:
    """Load ``model`` (a name such as ``demo`` or a checkpoint directory) as the engine does."""
    model_dir = resolve_model(model)
    obj, cfg = load_model(model_dir, "float32", "reference", "safetensors", 0, progress=False)
    tok = load_tokenizer(model_dir)
    return ServedModel(str(model), model_dir, obj, cfg, tok, model_identity(obj, cfg, str(model)),
                       min(max_window, cfg.max_position_embeddings))


class HiddenStateReader:
    """``read(token_ids, ends) -> float32 [len(ends), H]``: the final-norm hidden state of
    token ``end - 1`` for each ``end`` (the last token of the prefix ``token_ids[:end]``).

    Computed with the same weights through ``transformers`` (a dense causal forward,
    ~100x faster on CPU than the engine's paged reference attention over whole
    prompts); ``tests/test_predictor.py`` checks it equals the engine's hidden state
    (max |diff| ~4e-5 on SmolLM2-135M, float32). Run once per request over its
    whole context: causal attention makes each prefix's last state exact.
    """

    def __init__(self, served: ServedModel) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self._torch = torch
        self.served = served
        path = Path(served.model_dir)
        gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}   # (a GGUF file, dequantized as the engine does)
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent if gguf else path), dtype=torch.float32,
                                                          **gguf).eval()

    def read_many(self, contexts: list[tuple[tuple[int, ...], tuple[int, ...]]],
                  max_batch_tokens: int = 8192) -> list[np.ndarray]:
        """``read`` for many ``(token_ids, ends)`` at once: contexts that fit the window
        run as right-padded batches of similar length (at most ``max_batch_tokens``
        padded tokens per forward; causal attention keeps padding out of every real
        position), the others one by one. Returns one ``[len(ends), H]`` array per context."""
        torch = self._torch
        w = self.served.window
        out: list[np.ndarray | None] = [None] * len(contexts)
        spans = {i: max(ends) for i, (_, ends) in enumerate(contexts) if ends and max(ends) <= w}
        order = sorted(spans, key=spans.get)
        while order:
            longest = spans[order[0]]
            batch = []
            while order and (len(batch) + 1) * max(longest, spans[order[0]]) <= max(max_batch_tokens, longest):
                longest = max(longest, spans[order[0]])
                batch.append(order.pop(0))
            ids = np.zeros((len(batch), longest), np.int64)
            mask = np.zeros((len(batch), longest), np.int64)
            for row, i in enumerate(batch):
                ids[row, :spans[i]] = contexts[i][0][:spans[i]]
                mask[row, :spans[i]] = 1
            with torch.inference_mode():
                hidden = self.model.model(input_ids=torch.as_tensor(ids),
                                          attention_mask=torch.as_tensor(mask)).last_hidden_state
            for row, i in enumerate(batch):
                out[i] = hidden[row, [e - 1 for e in contexts[i][1]]].float().numpy()
        for i, (token_ids, ends) in enumerate(contexts):
            if out[i] is None:
                out[i] = self.read(token_ids, ends)
        return out

    def _run(self, ids: np.ndarray, rows: list[int]) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self.model.model(input_ids=torch.as_tensor(ids[None], dtype=torch.long))
        return out.last_hidden_state[0, rows].float().numpy()

    def read(self, token_ids: tuple[int, ...] | list[int], ends: tuple[int, ...] | list[int]) -> np.ndarray:
        w = self.served.window
        ids = np.asarray(token_ids, np.int64)
        result = np.zeros((len(ends), self.served.config.hidden_size), np.float32)
        inside = [i for i, e in enumerate(ends) if e <= w]
        if inside:
            span = max(ends[i] for i in inside)
            result[inside] = self._run(ids[:span], [ends[i] - 1 for i in inside])
        for i, e in enumerate(ends):
            if e > w:
                result[i] = self._run(ids[e - w:e], [w - 1])[0]
        return result
