"""Character-level text that is always present: Python's own `pydoc_data.topics`
(the help texts of the language reference, about 800 kB of English prose and code).

No download: the module ships with every CPython. `CharData` reads it as
characters; `TokenData` as subwords, with a byte-level BPE tokenizer (the
`tokenizers` package) trained on it or read from a checkpoint's `tokenizer.json`.
"""

import numpy as np


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


class CharData:
    """The text as integer ids, a vocabulary, and fixed-length windows."""

    def __init__(self, text: str | None = None):
        text = load_text() if text is None else text
        # Keep printable ASCII and newlines; map everything else to '?'.
        chars = [c if (" " <= c <= "~" or c == "\n") else "?" for c in text]
        self.vocab = sorted(set(chars))
        self.index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = np.array([self.index[c] for c in chars], dtype=np.int32)
        split = int(0.95 * len(self.ids))
        self.train_ids, self.eval_ids = self.ids[:split], self.ids[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def padded_vocab_size(self, multiple: int) -> int:
        """The vocabulary size rounded up to a multiple of `multiple`, for a
        vocabulary split over that many devices (the extra ids never occur)."""
        return -(-self.vocab_size // multiple) * multiple

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the character distribution: the loss of a model that
        ignores context."""
        counts = np.bincount(self.train_ids, minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def windows(
        self, rng: np.random.Generator, batch: int, length: int, *, split: str = "train"
    ) -> np.ndarray:
        """`batch` random windows of `length` consecutive ids: shape (batch, length)."""
        ids = self.train_ids if split == "train" else self.eval_ids
        starts = rng.integers(0, len(ids) - length, size=batch)
        return np.stack([ids[s : s + length] for s in starts])

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


class TokenData:
    """The text as BPE token ids: a byte-level BPE tokenizer trained on the text
    (`vocab_size` ids), or read from a `tokenizer.json` (a checkpoint's); the same
    windows, split and decoding as `CharData`."""

    def __init__(self, *, vocab_size: int = 512, tokenizer_file: str | None = None, text: str | None = None):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        text = load_text() if text is None else text
        if tokenizer_file is not None:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        else:
            self.tokenizer = Tokenizer(models.BPE())
            self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            self.tokenizer.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=vocab_size,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            self.tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
        self.ids = np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        split = int(0.95 * len(self.ids))
        self.train_ids, self.eval_ids = self.ids[:split], self.ids[split:]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def save(self, path) -> None:
        """Write `tokenizer.json` (as a checkpoint directory holds it)."""
        self.tokenizer.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    windows = CharData.windows
