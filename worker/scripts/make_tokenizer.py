"""Generate the reference tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and its corpus.

Why this script exists: the reference engine, the worker runtime and the gateway must agree on
token ids bit for bit (the gateway hashes the same chunks LMCache stores), and no tokenizer may
come from a hub. So the corpus is English prose generated here from a seeded grammar (our own
text, no downloads), and a byte-level BPE with exactly 8192 ids is trained on it with HF
``tokenizers``. Everything is deterministic: running the script twice writes identical bytes,
and a unit test checks that the committed files are what this script produces.

Usage: ``python worker/scripts/make_tokenizer.py [--out DIR]`` (default: the package assets).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

# Before importing tokenizers: one rayon thread keeps training order-independent of the box.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "src" / "kvpool" / "worker" / "assets"
# The tokenizer pair ships with kvpool.protocol (the gateway tokenizes with it too).
TOKENIZER_ASSETS = (
    Path(__file__).resolve().parents[2]
    / "protocol" / "src" / "kvpool" / "protocol" / "assets" / "reference_tokenizer"
)  # fmt: skip
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
SEED = 20260101
NUM_PARAGRAPHS = 1000

# ChatML, as a Jinja template (the form HF tokenizer_config.json and the gateway read).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _words(text: str) -> list[str]:
    return text.split()


NOUNS = _words(
    """
river mountain village city harbor garden forest meadow valley island bridge tower castle
road street market window door table chair lamp candle book letter page story song poem
voice silence morning evening night winter summer autumn spring season year month week day
hour minute moment memory dream thought idea question answer reason cause effect problem
solution method system engine machine wheel gear lever spring rope chain anchor sail ship
boat wagon carriage horse dog cat bird fish wolf fox deer bear rabbit owl crow sparrow
farmer teacher doctor sailor soldier merchant baker miller weaver painter writer reader
student scholar king queen prince princess child mother father brother sister friend
stranger neighbor traveler pilgrim captain guard keeper hunter shepherd priest judge
council court law rule promise secret treasure coin purse ring crown sword shield bow arrow
fire water stone iron gold silver copper glass salt bread wine milk honey apple pear grape
field farm barn mill well fountain stream lake sea ocean shore cliff cave hill plain desert
cloud rain snow wind storm thunder lightning sun moon star sky light shadow darkness color
music dance game feast festival journey voyage path trail map compass clock calendar
number measure weight length distance speed price cost wage debt gift trade craft skill
art science history language word name sign mark symbol picture image mirror frame box
basket bag cup plate bowl spoon knife fork kettle pot oven fireplace roof wall floor stair
room hall kitchen library school church temple palace prison office shop inn tavern camp
army fleet crowd family household tribe nation kingdom empire province county town port
paper ink pen brush canvas thread needle cloth coat hat boot glove cloak blanket bed pillow
garden flower rose lily tree oak pine willow birch leaf branch root seed grain wheat corn
cache memory server request token chunk block layer model worker pool controller gateway
network cluster node process thread queue buffer signal message packet stream channel
record table index key value tier disk storage prefix suffix batch schedule latency
"""
)

VERBS = _words(
    """
walk talk look open close carry follow answer ask call count cross wait watch wish work
listen learn laugh climb pull push turn return remember finish start visit travel paint
gather wander whisper shout help jump kick kiss laugh love move name order pass plant play
pray reach rest roll save search share smile stay stop touch trust visit want warn wash
measure mend mark fill fold guard hunt join kill knock land lift march offer pick plan
cook clean collect compare consider contain continue cover dance decide deliver describe
design destroy develop discover divide doubt enjoy enter escape explain fear form gain
greet guide handle happen hope hurry imagine improve include increase invent kneel last
lead learn mention mix notice obey observe owe pause perform please prefer prepare
present pretend print promise protect prove punish question rain realize receive record
reduce refuse remain repair repeat reply report request rescue return reward sail settle
shelter sign signal sort spell spill steer store struggle suffer supply support suppose
surprise tempt thank trace trade train travel treat tremble trouble visit wander warm
"""
)

IRREGULAR = {
    "begin": "began",
    "bring": "brought",
    "build": "built",
    "buy": "bought",
    "catch": "caught",
    "choose": "chose",
    "come": "came",
    "draw": "drew",
    "drink": "drank",
    "drive": "drove",
    "eat": "ate",
    "fall": "fell",
    "find": "found",
    "fly": "flew",
    "forget": "forgot",
    "give": "gave",
    "go": "went",
    "grow": "grew",
    "hear": "heard",
    "hold": "held",
    "keep": "kept",
    "know": "knew",
    "leave": "left",
    "lose": "lost",
    "make": "made",
    "meet": "met",
    "ride": "rode",
    "ring": "rang",
    "rise": "rose",
    "run": "ran",
    "say": "said",
    "see": "saw",
    "sell": "sold",
    "send": "sent",
    "sing": "sang",
    "sit": "sat",
    "sleep": "slept",
    "speak": "spoke",
    "stand": "stood",
    "swim": "swam",
    "take": "took",
    "teach": "taught",
    "tell": "told",
    "think": "thought",
    "throw": "threw",
    "understand": "understood",
    "wake": "woke",
    "wear": "wore",
    "win": "won",
    "write": "wrote",
}

ADJECTIVES = _words(
    """
old young new ancient quiet loud bright dark warm cold soft hard gentle rough small large
tiny huge narrow wide deep shallow high low long short heavy light quick slow early late
happy sad brave kind cruel wise foolish clever honest proud humble rich poor strong weak
green blue red yellow white black grey golden silver wooden stone iron empty full open
closed hidden secret strange familiar distant nearby simple careful patient curious
silent noisy busy idle clean dirty fresh stale sweet bitter sour salty plain fancy calm
wild tame free certain sudden gradual steady fragile sturdy thin thick bare green bold
faithful grateful hopeful restless tireless broken whole common rare local remote fast
"""
)

ADVERBS_EXTRA = _words("then soon again often never always perhaps still once twice already almost")
PREPOSITIONS = _words(
    "in on under over beside behind before after across along through near toward into"
)
CONJUNCTIONS = ["and", "but", "while", "because", "although", "until", "since", "so", "yet"]
DETERMINERS = ["the", "a", "the", "this", "that", "every", "one", "each", "the"]
PRONOUNS = ["he", "she", "they", "we", "it", "you", "I"]
SYLLABLES = _words(
    """
al bar cor dan el fen gar hal ir jor kel lin mar nor ol per quin ros sel tor ul var wen
xan yor zel bri cla dru fro gra kri pla sto tra vel mor ain eth ic os un ard wyn
"""
)

TECH_SENTENCES = [
    "The worker stores each chunk of {n} tokens in the local CPU tier.",
    "A request with a long prefix reads its cached blocks from {tier} before prefill.",
    "The gateway hashes the prompt and asks the controller which instance holds the prefix.",
    "When the pool is full, the least recently used chunks are evicted first.",
    "Time to first token fell from {a} ms to {b} ms after the cache was warm.",
    "Each layer keeps keys and values in blocks of {m} slots.",
    "The scheduler admits {k} requests at once and decodes them together.",
    "A missing or corrupted chunk is treated as a miss, never as wrong data.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "Please answer the user's questions about the story.",
]
QUESTIONS = [
    "Hello! What happened to {np}?",
    "How do I {verb} {np}?",
    "Why did they {verb} {np}?",
    "Can you tell me a story about {np}?",
    "Please explain what {np} means.",
    "Where is {np}? Thank you.",
]
TIERS = ["DDR", "the local disk", "Redis", "the Mooncake store", "a peer"]


def _past(verb: str) -> str:
    if verb in IRREGULAR:
        return IRREGULAR[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _ing(verb: str) -> str:
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith("f"):
        return noun[:-1] + "ves"
    return noun + "s"


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


class _Prose:
    """A tiny seeded grammar: enough variety that BPE learns real English pieces."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.verbs = sorted(set(VERBS) | set(IRREGULAR))
        self.names = [_name(rng) for _ in range(1500)]
        self.short_nouns = [n for n in NOUNS if len(n) <= 5]

    def noun(self) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.12:  # compounds: firelight, lampkeeper, stonebridge
            return r.choice(self.short_nouns) + r.choice(self.short_nouns)
        if roll < 0.18:
            return r.choice(ADJECTIVES) + r.choice(["ness", "ity", "hood"])
        if roll < 0.22:
            return r.choice(self.verbs) + r.choice(["er", "ment", "ance"])
        return r.choice(NOUNS)

    def adjective(self) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.08:
            return "un" + r.choice(ADJECTIVES)
        if roll < 0.16:
            return r.choice(NOUNS) + r.choice(["less", "ful", "like", "ish", "y"])
        if roll < 0.22:
            return r.choice(ADJECTIVES) + r.choice(["er", "est"])
        if roll < 0.26:
            return _past(r.choice(self.verbs))
        return r.choice(ADJECTIVES)

    def noun_phrase(self) -> str:
        r = self.rng
        noun = self.noun()
        if r.random() < 0.3:
            noun = _plural(noun)
            det = r.choice(["the", "some", "many", "few", "those", "these", "all the"])
        else:
            det = r.choice(DETERMINERS)
            if det == "a" and noun[0] in "aeiou":
                det = "an"
        if r.random() < 0.5:
            adj = self.adjective()
            if det == "an" and adj[0] not in "aeiou":
                det = "a"
            elif det == "a" and adj[0] in "aeiou":
                det = "an"
            noun = f"{adj} {noun}"
        return f"{det} {noun}"

    def subject(self) -> str:
        r = self.rng.random()
        if r < 0.25:
            return self.rng.choice(self.names)
        if r < 0.4:
            return self.rng.choice(PRONOUNS)
        return self.noun_phrase()

    def clause(self) -> str:
        r = self.rng
        verb = r.choice(self.verbs)
        if r.random() < 0.1:
            verb = r.choice(["re", "un", "over", "out", "mis"]) + verb
        form = r.random()
        if form < 0.1:
            predicate = verb + ("es" if verb.endswith(("s", "sh", "ch")) else "s")
        elif form < 0.55:
            predicate = _past(verb)
        elif form < 0.75:
            predicate = f"was {_ing(verb)}"
        elif form < 0.9:
            predicate = f"would {verb}"
        else:
            predicate = f"had {_past(verb)}"
        parts = [self.subject(), predicate]
        if r.random() < 0.6:
            parts.append(self.noun_phrase())
        if r.random() < 0.5:
            parts.append(f"{r.choice(PREPOSITIONS)} {self.noun_phrase()}")
        if r.random() < 0.25:
            adj = r.choice(ADJECTIVES)
            parts.append(r.choice(ADVERBS_EXTRA) if r.random() < 0.5 else f"{adj}ly")
        return " ".join(parts)

    def sentence(self) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.06:
            text = r.choice(TECH_SENTENCES).format(
                n=r.choice([64, 128, 256, 512]),
                tier=r.choice(TIERS),
                a=r.randint(200, 9000),
                b=r.randint(10, 900),
                m=r.choice([16, 32, 64, 128]),
                k=r.randint(2, 64),
            )
            return text
        text = self.clause()
        if roll < 0.35:
            text = f"{text}, {r.choice(CONJUNCTIONS)} {self.clause()}"
        elif roll < 0.42:
            quote = self.clause()
            speaker = r.choice(self.names)
            verb = r.choice(["said", "asked", "whispered", "answered"])
            return f'"{quote[0].upper()}{quote[1:]}," {speaker} {verb}.'
        elif roll < 0.48:
            year = r.randint(1200, 2099)
            text = f"In {year}, {text}"
        end = "?" if r.random() < 0.08 else ("!" if r.random() < 0.04 else ".")
        return text[0].upper() + text[1:] + end

    def dialog(self) -> str:
        r = self.rng
        question = r.choice(QUESTIONS).format(np=self.noun_phrase(), verb=r.choice(self.verbs))
        answer = " ".join(self.sentence() for _ in range(r.randint(1, 3)))
        return f"system\n{r.choice(SYSTEM_PROMPTS)}\nuser\n{question}\nassistant\n{answer}"

    def paragraph(self) -> str:
        if self.rng.random() < 0.08:
            return self.dialog()
        return " ".join(self.sentence() for _ in range(self.rng.randint(3, 9)))


def make_corpus(seed: int = SEED, paragraphs: int = NUM_PARAGRAPHS) -> str:
    prose = _Prose(random.Random(seed))
    return "\n\n".join(prose.paragraph() for _ in range(paragraphs)) + "\n"


def train_tokenizer(corpus: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = corpus.split("\n\n")
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {size} ids, expected {VOCAB_SIZE}: grow the corpus")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise SystemExit(f"special token {token} is not id {token_id}")
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8704,
        "chat_template": CHAT_TEMPLATE,
    }


def write_all(out: Path, tokenizer_out: Path | None = None) -> list[Path]:
    """The corpus into ``out``, the tokenizer pair into ``tokenizer_out`` (default ``out``)."""
    tok_dir = out if tokenizer_out is None else tokenizer_out
    for directory in (out, tok_dir):
        directory.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus()
    corpus_path = out / "corpus.txt"
    corpus_path.write_text(corpus, encoding="utf-8")
    tokenizer = train_tokenizer(corpus)
    tok_path = tok_dir / "tokenizer.json"
    tok_path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return [corpus_path, tok_path, cfg_path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="one output directory (default: the committed asset places)"
    )
    args = parser.parse_args(argv)
    written = write_all(args.out) if args.out else write_all(ASSETS, TOKENIZER_ASSETS)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
