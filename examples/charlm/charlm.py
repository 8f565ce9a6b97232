"""A small character-level transformer language model on procedurally generated text.

A hybridtrain task: `hybridtrain train --task charlm:task --target 'val_loss<=0.9'`.
The text comes from a tiny deterministic grammar ("the old fox sees a red box near the tree.")
drawn with fixed seeds, so it needs no download and every rank builds the same corpus; the
training and held-out texts are drawn from different seeds.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import hybridtrain

ALPHABET = "\n .abcdefghijklmnopqrstuvwxyz"
ARTICLES = ("the", "a", "every", "one")
ADJECTIVES = ("old", "red", "small", "quiet", "bright", "tired", "green", "brave")
NOUNS = ("fox", "box", "tree", "child", "river", "king", "robot", "garden", "bird", "stone")
VERBS = ("sees", "finds", "likes", "follows", "paints", "hears", "moves", "guards")
PLACES = ("near", "under", "behind", "beside")


def sentence(rng: random.Random) -> str:
    """One sentence of the grammar: NP VP [PREP NP]."""

    def noun_phrase() -> str:
        words = [rng.choice(ARTICLES)]
        if rng.random() < 0.5:
            words.append(rng.choice(ADJECTIVES))
        words.append(rng.choice(NOUNS))
        return " ".join(words)

    text = f"{noun_phrase()} {rng.choice(VERBS)} {noun_phrase()}"
    if rng.random() < 0.4:
        text += f" {rng.choice(PLACES)} {noun_phrase()}"
    return text + ".\n"


def corpus(chars: int, seed: int) -> torch.Tensor:
    """At least `chars` characters of the grammar's text as alphabet indices."""
    rng, parts, size = random.Random(seed), [], 0
    while size < chars:
        parts.append(sentence(rng))
        size += len(parts[-1])
    index = {c: i for i, c in enumerate(ALPHABET)}
    return torch.tensor([index[c] for c in "".join(parts)], dtype=torch.long)


class Windows(Dataset):
    """(context, next characters) pairs: windows of `context + 1` characters every `stride`."""

    def __init__(self, text: torch.Tensor, context: int, stride: int) -> None:
        self.text, self.context, self.stride = text, context, stride

    def __len__(self) -> int:
        return (len(self.text) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i * self.stride : i * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    """Token and position embeddings, a causal TransformerEncoder, a linear head to the alphabet."""

    def __init__(self, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(ALPHABET), dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, len(ALPHABET))
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch, positions, alphabet) for the character after each position."""
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def sequence_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of every sequence (nats per character)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def char_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sequence, the fraction of next characters predicted exactly."""
    return (output.argmax(-1) == target).float().mean(-1)


def warmup_cosine(warmup_steps: int):
    """schedule(optimizer, max_steps): linear warm-up, then cosine to a tenth of the peak rate."""

    def schedule(optimizer: torch.optim.Optimizer, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return schedule


def task(context: int = 48, dim: int = 128, layers: int = 2, heads: int = 4, lr: float = 3e-3,
         weight_decay: float = 0.01, warmup_steps: int = 20, train_chars: int = 200_000,
         eval_chars: int = 20_000) -> hybridtrain.Task:
    """The character LM task; every argument can be set with --task-args JSON."""
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
    return hybridtrain.Task(
        model=lambda: CharTransformer(context, dim, layers, heads),
        train_data=Windows(corpus(train_chars, seed=1), context, stride=context // 2),
        eval_data=Windows(corpus(eval_chars, seed=2), context, stride=context),
        loss=sequence_loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay),
        metrics=[hybridtrain.Metric("char_accuracy", char_accuracy)],
        schedule=warmup_cosine(warmup_steps),
        eval_batch_size=256,
    )
