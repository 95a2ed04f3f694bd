"""The workloads' vocabulary: real words, each about one token in a BPE vocabulary, and the
tokenizer of engines without a model (mock and simulated ones): one id per word."""

from __future__ import annotations

import random

# Common English nouns and adjectives; each is exactly one token after a space in SmolLM2's
# GPT-2 style vocabulary (checked with its tokenizer), and one or two in other BPE vocabularies.
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face level office door health person art war history party result change morning reason research
girl moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect class control care field development role effort rate
heart show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population truth song
river garden bridge summer winter spring autumn green blue red small large quick slow bright dark
happy early late""".split()

# Ids below this are special (EOS is 0 in a mock model).
FIRST_WORD_ID = 3
_WORD_IDS = {w: FIRST_WORD_ID + i for i, w in enumerate(WORDS)}


def words(rng: random.Random, n: int) -> str:
    """`n` words drawn from WORDS."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


class WordTokenizer:
    """Text of WORDS <-> ids, one id per word (whitespace-separated); any other word is
    refused: a mock engine serves the workloads' prompts, not arbitrary text."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < FIRST_WORD_ID + len(WORDS):
            raise ValueError(f"vocab_size must be >= {FIRST_WORD_ID + len(WORDS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = None
        self.eos_token_id = 0
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        try:
            return [_WORD_IDS[w] for w in text.split()]
        except KeyError as exc:
            raise ValueError(f"word {exc.args[0]!r} is not in the mock vocabulary") from None

    def decode(self, token_ids) -> str:
        return " ".join(WORDS[t - FIRST_WORD_ID] if FIRST_WORD_ID <= t < FIRST_WORD_ID + len(WORDS)
                        else f"<{t}>" for t in token_ids)
