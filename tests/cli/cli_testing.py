"""Helpers shared by the command-line tests (tests/cli/test_*.py)."""


def write_corpus(path, words=40000):
    """A small English-like corpus made on the spot (~190 KB: enough for the train and validation
    splits), so that the tests rely neither on the default corpus nor on files outside the tree."""
    vocab = "the quick brown fox jumps over a lazy dog and cat sleeps in warm sun".split()
    x, out = 12345, []
    for _ in range(words):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(vocab[(x >> 33) % len(vocab)] + (".\n" if (x >> 20) % 9 == 0 else " "))
    with open(path, "w") as f:
        f.write("".join(out))
