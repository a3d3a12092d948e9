"""The models and batches of ``bench_mixed_precision.py`` and of its 2-rank row (``_mixed_precision_ranks``).

Both import them from here, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["build", "corpus", "size"]


def size(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "encoder": {"layers": 2, "d_model": 32, "heads": 2, "feedforward": 64, "batch": 2, "tokens": 8},
            "gpt2": {
                "layers": 1,
                "embd": 32,
                "heads": 2,
                "vocab": 64,
                "batch": 2,
                "tokens": 16,
                "torch_only": True,
            },
            "quality_steps": 20,
        }
    return {
        "encoder": {"layers": 6, "d_model": 256, "heads": 4, "feedforward": 1024, "batch": 8, "tokens": 64},
        "gpt2": {"layers": 2, "embd": 128, "heads": 4, "vocab": 1024, "batch": 8, "tokens": 64},
        "quality_steps": 300,
    }


def build(name: str, size: dict[str, Any]) -> tuple[Any, Any, Callable[[Any, Any], Any]]:
    """Return (model, batch maker, loss of model on a batch), seeded."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "encoder":
        s = size["encoder"]
        layer = nn.TransformerEncoderLayer(
            s["d_model"], s["heads"], s["feedforward"], dropout=0.0, batch_first=True
        )
        model = nn.TransformerEncoder(layer, s["layers"], enable_nested_tensor=False)
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randn(s["batch"], s["tokens"], s["d_model"], generator=gen) for _ in range(4)]

        def loss(m: Any, x: Any) -> Any:
            return m(x).float().square().mean()

        return model, batches, loss
    s = size["gpt2"]
    batches = [corpus(s, i) for i in range(4)]

    def lm_loss(m: Any, ids: Any) -> Any:
        out = m(input_ids=ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )

    if s.get("torch_only"):
        return _TinyLM(s["vocab"], s["embd"]), batches, lm_loss
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=s["vocab"],
        n_positions=s["tokens"],
        n_embd=s["embd"],
        n_layer=s["layers"],
        n_head=s["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config), batches, lm_loss


def _tiny_lm_class() -> Any:
    from torch import nn

    class TinyLM(nn.Module):
        """``--quick``'s stand-in of the GPT-2: embedding, norm, MLP, tied head."""

        def __init__(self, vocab: int, dim: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.norm = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, input_ids: Any) -> Any:
            h = self.embed(input_ids)
            return self.head(h + self.mlp(self.norm(h)))

    return TinyLM


def _TinyLM(vocab: int, dim: int) -> Any:
    return _tiny_lm_class()(vocab, dim)


def corpus(s: dict[str, Any], i: int) -> Any:
    """A learnable synthetic batch: arithmetic sequences of token ids with per-row steps."""
    import torch

    gen = torch.Generator().manual_seed(100 + i)
    start = torch.randint(0, s["vocab"], (s["batch"], 1), generator=gen)
    step = torch.randint(1, 8, (s["batch"], 1), generator=gen)
    return (start + step * torch.arange(s["tokens"])) % s["vocab"]
