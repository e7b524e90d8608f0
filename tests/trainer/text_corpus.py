"""A small English-like corpus for the tests of `data prepare` and of what trains on it."""

import random

SUBJECTS = ["the cat", "a dog", "my old friend", "the tall man", "a small bird", "her sister"]
VERBS = ["sat on", "looked at", "ran to", "jumped over", "walked past"]
OBJECTS = ["the mat", "a green tree", "the house", "the river", "a red car"]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(1, 3))) for _ in range(n)]
