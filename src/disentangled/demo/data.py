"""Small built-in datasets: text to train a SentencePiece model on, and labelled tasks a tiny model can learn.

The demo and the tests use them where nothing can be downloaded. Every generator is seeded and returns plain
dicts, written to CSV / JSON lines for `datasets`' local-file loaders with `write_rows`.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

NEUTRAL_WORDS = (
    "the a an cat dog bird sat ran flew on under over mat rug tree quick brown lazy fox river bank money market "
    "stock bond capital city is was of and in to movie film book story what where who when which question answer "
    "today yesterday very quite really this that it we they"
).split()
POSITIVE_WORDS = "good great happy love wonderful excellent".split()
NEGATIVE_WORDS = "bad terrible sad hate awful boring".split()
CITIES = "paris berlin rome madrid london vienna".split()
COUNTRIES = "france germany italy spain england austria".split()
VOCABULARY = NEUTRAL_WORDS + POSITIVE_WORDS + NEGATIVE_WORDS + CITIES + COUNTRIES


def corpus_lines(count: int = 3000, seed: int = 0) -> list[str]:
    """Sentences of the built-in vocabulary, to train a SentencePiece model on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(4, 14))) + "." for _ in range(count)]


def train_sentencepiece(directory: str | Path, lines: list[str], vocab_size: int = 100) -> Path:
    """A unigram SentencePiece model on `lines`, with DeBERTa-v3's reserved ids ([PAD] 0, [CLS] 1, [SEP] 2,
    [UNK] 3); returns the path of `spm.model` in `directory`."""
    import sentencepiece

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "spm"),
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        pad_piece="[PAD]",
        bos_id=1,
        bos_piece="[CLS]",
        eos_id=2,
        eos_piece="[SEP]",
        unk_id=3,
        unk_piece="[UNK]",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    corpus.unlink()
    (directory / "spm.vocab").unlink(missing_ok=True)
    return directory / "spm.model"


def sentiment_examples(count: int, seed: int = 0) -> list[dict]:
    """`{"text", "label"}`: neutral words around one sentiment word; the label says which kind ("negative" /
    "positive"), so a model must find that word wherever it is. Balanced; chance is 0.5."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        positive = index % 2 == 0
        words = [rng.choice(NEUTRAL_WORDS) for _ in range(rng.randint(4, 12))]
        words.insert(rng.randint(0, len(words)), rng.choice(POSITIVE_WORDS if positive else NEGATIVE_WORDS))
        rows.append({"text": " ".join(words), "label": "positive" if positive else "negative"})
    rng.shuffle(rows)
    return rows


def tagging_examples(count: int, seed: int = 0) -> list[dict]:
    """`{"tokens", "tags"}`: words tagged B-LOC (a city or country) or O."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        tokens = [rng.choice(NEUTRAL_WORDS) for _ in range(rng.randint(4, 10))]
        for _ in range(rng.randint(1, 2)):
            tokens.insert(rng.randint(0, len(tokens)), rng.choice(CITIES + COUNTRIES))
        rows.append({"tokens": tokens, "tags": ["B-LOC" if t in CITIES + COUNTRIES else "O" for t in tokens]})
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """CSV for a `.csv` path (flat rows), JSON lines otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ANIMALS = "cat dog fox bird".split()
PLACES = "mat rug tree river bank".split()
WORKS = "movie film book story".split()


def pretraining_lines(count: int = 3000, seed: int = 0) -> list[str]:
    """Sentences with structure a small model can learn, for the demo's and the benchmark's pretraining.

    Unlike `corpus_lines` (words in random order), every sentence follows a template with agreement to learn:
    each city is the capital of one country (CITIES[i] of COUNTRIES[i]), a sentence's sentiment words agree
    ("we love this film , it was wonderful"), animals sit or run on places. A masked city, country or sentiment
    word can be guessed from the rest of the sentence, so fill-mask answers show whether a model learned.
    """
    rng = random.Random(seed)

    def fact() -> str:
        index = rng.randrange(len(CITIES))
        city, country = CITIES[index], COUNTRIES[index]
        return rng.choice(
            [
                f"{city} is the capital of {country}.",
                f"the capital of {country} is {city}.",
                f"what is the capital of {country}? the answer is {city}.",
                f"they flew to {city} in {country} {rng.choice(['today', 'yesterday'])}.",
            ]
        )

    def opinion() -> str:
        positive = rng.random() < 0.5
        verb, words = ("love", POSITIVE_WORDS[1:]) if positive else ("hate", NEGATIVE_WORDS[1:])
        good_or_bad = "good" if positive else "bad"
        work = rng.choice(WORKS)
        return rng.choice(
            [
                f"we {verb} this {work}, it was {rng.choice(words)}.",
                f"the {work} was {rng.choice(['very', 'quite', 'really'])} {rng.choice(words)} and we {verb} it.",
                f"a {good_or_bad} {work}: {rng.choice(words)}, {rng.choice(words)}, they {verb} it.",
            ]
        )

    def scene() -> str:
        animal, place = rng.choice(ANIMALS), rng.choice(PLACES)
        if animal == "bird":
            return f"the bird flew over the {rng.choice(['tree', 'river'])}."
        adjective = rng.choice(["quick brown", "lazy", "brown"])
        return f"the {adjective} {animal} {rng.choice(['sat', 'ran'])} {rng.choice(['on', 'under'])} the {place}."

    def money() -> str:
        return rng.choice(
            [
                f"the stock market was {rng.choice(['good', 'bad'])} {rng.choice(['today', 'yesterday'])}.",
                "they put the money in the bank.",
                "a bond is a question of money and capital.",
            ]
        )

    makers = [fact, fact, opinion, opinion, scene, money]
    return [rng.choice(makers)() for _ in range(count)]


def capital_examples(count: int, cities: list[str] | None = None, seed: int = 0) -> list[dict]:
    """`{"text", "label"}`: "CITY is the capital of COUNTRY." labelled "true" when the pair matches (as in
    `pretraining_lines`), else "false"; balanced. `cities` (at least two) restricts the cities asked about, and the
    countries to theirs, so that each country is as often in a true sentence as in a false one: a task can fine-tune
    on some cities and evaluate on the others, and no country alone gives the label away (with every country in the
    false sentences, those of the held-out cities were "false" words in training, the opposite of the answer)."""
    rng = random.Random(seed)
    cities = cities or CITIES
    if len(cities) < 2:
        raise ValueError(f"capital_examples needs at least two cities to draw false pairs from, got {cities}")
    countries = [COUNTRIES[CITIES.index(city)] for city in cities]
    rows = []
    for index in range(count):
        city = rng.choice(cities)
        country = COUNTRIES[CITIES.index(city)]
        true = index % 2 == 0
        if not true:
            country = rng.choice([other for other in countries if other != country])
        rows.append({"text": f"{city} is the capital of {country}.", "label": "true" if true else "false"})
    rng.shuffle(rows)
    return rows


# Real text that every Python installation ships: the reference manual's topics (pydoc_data) and the docstrings of
# the standard library. English prose written by people, about 280,000 words with Python 3.11; nothing is downloaded.
TOPIC_PACKAGES = ("asyncio", "email", "tkinter", "xml")  # the topics of `python_docs_topics`


def python_docs_documents(min_words: int = 20) -> list[dict]:
    """`{"text", "source"}`: the language reference's topics (source "reference/TOPIC") and every docstring of at
    least `min_words` words in the standard library's own modules (source: the module's path, e.g. "email/utils.py";
    tests, idlelib and site-packages left out). Sorted by source, so the list is the same on every run."""
    import ast
    import pydoc_data.topics
    import sysconfig

    documents = [
        {"text": text, "source": f"reference/{name}"} for name, text in sorted(pydoc_data.topics.topics.items())
    ]
    library = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(library.rglob("*.py")):
        parts = path.relative_to(library).parts
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3") for part in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text.split()) >= min_words:
                    documents.append({"text": text, "source": "/".join(parts)})
    return documents


def python_docs_split(held_out_every: int = 5) -> tuple[list[dict], list[dict]]:
    """(training, held-out) documents of `python_docs_documents`, split by source file: every `held_out_every`-th
    file (in sorted order) is held out whole, so held-out text is never seen in pretraining."""
    documents = python_docs_documents()
    sources = sorted({document["source"] for document in documents})
    held_out = set(sources[::held_out_every])
    return (
        [document for document in documents if document["source"] not in held_out],
        [document for document in documents if document["source"] in held_out],
    )


def python_docs_topics(documents: list[dict], per_topic: int | None = None, seed: int = 0) -> list[dict]:
    """`{"text", "label"}`: the documents of the packages in `TOPIC_PACKAGES`, labelled by package (4 classes,
    chance 0.25), at most `per_topic` of each, shuffled with `seed`. What tells the topics apart is vocabulary and
    phrasing that pretraining on the rest of the text can teach."""
    rng = random.Random(seed)
    rows = []
    for topic in TOPIC_PACKAGES:
        mine = [d for d in documents if d["source"].startswith(topic + "/") or d["source"] == topic + ".py"]
        rng.shuffle(mine)
        rows += [{"text": " ".join(d["text"].split()[:96]), "label": topic} for d in mine[:per_topic]]
    rng.shuffle(rows)
    return rows
