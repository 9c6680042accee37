"""Synthetic retrieval tasks in real text, in the style of RULER's (written here, seeded):
facts inserted at line starts of a window of a real text (`bench.texts`), then a question
that only those facts answer.

- "multi-key": four facts "The special magic number for ADJECTIVE-NOUN is: N."; the
  question asks for one key's number, the other three are distractors.
- "variable-tracking": "The value N is assigned to VAR A." and "VAR A is copied to VAR
  B." scattered in the text, beside two distractor assignments of other values to other
  variables; the question asks which variables hold N, the answer names A, then B.
- "common-words": lines "Word: W." for made-up words: one 8 times, six others once each,
  in random order; the question asks for the most frequent word.

The answers are written in the facts' own words ("The value N is assigned to VAR A. VAR
A is copied to VAR B", "Word: W"), and only their numbers, names and words are scored
(`solved`): SmolLM2-135M-Instruct writes its own format where an answer's format is free
(a blank line first, "and" between names), which says nothing about retrieval.

Simpler than RULER's, so that dense attention on that model solves most items
(docs/tuning.md: retrieval-task-forms); `variable_tracking` and `common_words` take
harder shapes as arguments.

Each item is a prompt and its answer, `length` tokens together, the answer last (a
length that is a multiple of the block size puts the question and the answer in the last
query block). "chat" prompts wrap the instruction, the text and the question in the
model's chat template, the answer's lead-in opening the assistant's turn; "plain" prompts
are the same without the template.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FORMATS = ("chat", "plain")
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow",
              "icy", "jolly", "kind", "lucky", "misty", "noble", "odd", "proud", "quiet",
              "rapid", "silent", "tidy", "vivid", "warm", "young", "zesty")
NOUNS = ("anchor", "badger", "candle", "dragon", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry",
         "river", "saddle", "tunnel", "valley", "walnut", "willow", "zebra", "beacon")
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class Task:
    """What a task's generator makes before it meets the text: `facts` (lines, in the
    order they appear), the instruction before the text, the question after it, the
    answer's lead-in, and the answer's pieces: alternately scored (a number, a name, a
    word: what the facts give) and given (the format between them), the first scored."""

    facts: tuple[str, ...]
    instruction: str
    question: str
    lead_in: str
    pieces: tuple[str, ...]

    @property
    def answer(self) -> str:
        return "".join(self.pieces)


@dataclasses.dataclass(frozen=True)
class Item:
    """One prompt of a task: token ids (ints) `prompt` and `answer` (the answer follows
    the prompt), `scored` (per answer token, whether it belongs to a scored piece rather
    than to the format between), the answer's text, and the inserted facts in prompt
    order."""

    task: str
    seed: tuple[int, ...]
    prompt: list[int]
    answer: list[int]
    scored: list[bool]
    answer_text: str
    facts: tuple[str, ...]


# --- the tasks -------------------------------------------------------------------------

def multi_key(rng: np.random.Generator, keys: int = 4) -> Task:
    """`keys` facts "The special magic number for ADJECTIVE-NOUN is: N." (distinct keys,
    distinct 5-digit numbers) in random order; the question asks for one key's number."""
    if keys < 1:
        raise ValueError(f"keys must be at least 1, got {keys}")
    names = [f"{ADJECTIVES[a]}-{NOUNS[n]}" for a, n in zip(
        rng.choice(len(ADJECTIVES), keys, replace=False),
        rng.choice(len(NOUNS), keys, replace=False))]
    numbers = rng.choice(np.arange(10000, 100000), keys, replace=False)
    asked = int(rng.integers(keys))
    return Task(
        facts=tuple(f"The special magic number for {k} is: {n}." for k, n in
                    zip(names, numbers)),
        instruction="Some special magic numbers are hidden in the following text. "
                    "Remember them: I will ask you about one of them.",
        question=f"What is the special magic number for {names[asked]}?",
        lead_in=f"The special magic number for {names[asked]} is: ",
        pieces=(str(numbers[asked]),))


def variable_tracking(rng: np.random.Generator, hops: int = 1, distractors: int = 2,
                      distractor_hops: int = 0) -> Task:
    """A chain of `hops` + 1 variables (distinct nouns): "The value N is assigned to VAR
    A.", then "VAR A is copied to VAR B.", ...; and `distractors` chains of
    `distractor_hops` + 1 other variables, each from another 5-digit value. The lines
    are interleaved at random, each chain's in its order. The question asks which
    variables hold the first chain's value; the answer follows the chain in the facts'
    words, scoring each variable's name."""
    if hops < 1 or distractors < 0 or distractor_hops < 0:
        raise ValueError(f"hops must be at least 1, distractors and distractor_hops at "
                         f"least 0: got {hops}, {distractors}, {distractor_hops}")
    sizes = [hops + 1] + [distractor_hops + 1] * distractors
    if sum(sizes) > len(NOUNS):
        raise ValueError(f"hops {hops}, distractors {distractors} and distractor_hops "
                         f"{distractor_hops} need {sum(sizes)} names, more than "
                         f"{len(NOUNS)}")
    names = [NOUNS[i] for i in rng.choice(len(NOUNS), sum(sizes), replace=False)]
    numbers = rng.choice(np.arange(10000, 100000), len(sizes), replace=False)
    chains = [names[sum(sizes[:c]):sum(sizes[:c + 1])] for c in range(len(sizes))]
    lines = [[f"The value {n} is assigned to VAR {chain[0]}."]
             + [f"VAR {a} is copied to VAR {b}." for a, b in zip(chain, chain[1:])]
             for n, chain in zip(numbers, chains)]
    order = rng.permutation([c for c, size in enumerate(sizes) for _ in range(size)])
    chain = chains[0]
    return Task(
        facts=tuple(lines[c].pop(0) for c in order),
        instruction="Some variable assignments are hidden in the following text. "
                    "Remember them: I will ask you which variables hold a value.",
        question=f"Which variables hold the value {numbers[0]}? Follow the assignments.",
        lead_in=f"The value {numbers[0]} is assigned to VAR",
        pieces=(f" {chain[0]}",) + tuple(p for a, b in zip(chain, chain[1:])
                                         for p in (f". VAR {a} is copied to VAR", f" {b}")))


def made_up_words(rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct lower-case words of 2 or 3 random consonant-vowel syllables."""
    words: list[str] = []
    while len(words) < count:
        syllables = int(rng.integers(2, 4))
        word = "".join(rng.choice(list(CONSONANTS)) + rng.choice(list(VOWELS))
                       for _ in range(syllables))
        if word not in words:
            words.append(word)
    return words


def common_words(rng: np.random.Generator, counts=(8,), distractors: int = 6,
                 distractor_count: int = 1) -> Task:
    """Lines "Word: W." in random order: one made-up word per entry of `counts`, that
    many times (distinct counts, descending), and `distractors` words `distractor_count`
    times each (fewer than the last count). The question asks for the len(counts) most
    frequent words; the answer writes them as such lines, from the most frequent down,
    scoring each word."""
    counts = tuple(int(c) for c in counts)
    if (not counts or list(counts) != sorted(set(counts), reverse=True)
            or not 0 < distractor_count < counts[-1]):
        raise ValueError(f"counts must be distinct and descending, each above "
                         f"distractor_count, itself at least 1: got {counts} and "
                         f"{distractor_count}")
    words = made_up_words(rng, len(counts) + distractors)
    times = list(counts) + [distractor_count] * distractors
    lines = [f"Word: {w}." for w, n in zip(words, times) for _ in range(n)]
    top = len(counts)
    asked = "word is" if top == 1 else f"{top} words are"
    return Task(
        facts=tuple(lines[i] for i in rng.permutation(len(lines))),
        instruction="Some words are hidden in the following text, each on a line "
                    "starting with \"Word:\". Count them: I will ask you which are the "
                    "most frequent.",
        question=f"Which {asked} the most frequent on the \"Word:\" lines?",
        lead_in=f"The most frequent {asked}:\n\nWord:",
        pieces=tuple(p for w in words[:top] for p in (".\nWord:", f" {w}"))[1:])


TASKS = {"multi-key": multi_key, "variable-tracking": variable_tracking,
         "common-words": common_words}


# --- prompts ---------------------------------------------------------------------------

class Haystack:
    """A text's token ids (`tokens`, ints) and the positions where its lines begin, after
    a token that holds a newline (`line_starts`, int64 `[lines]`, ascending): where facts
    go."""

    def __init__(self, tokenizer, tokens: list[int]):
        newline = {t for t in set(tokens) if "\n" in tokenizer.decode([t])}
        self.tokens = list(tokens)
        self.line_starts = np.asarray([i for i in range(1, len(tokens))
                                       if tokens[i - 1] in newline], np.int64)


CONTEXT = "\x00CONTEXT\x00"  # stands for the text while the template is rendered


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def frame(tokenizer, task: Task, form: str):
    """Token ids before the text and after it (up to the answer), the answer's, and
    whether each answer token is scored (belongs to a scored piece, not to the format)."""
    if form not in FORMATS:
        raise ValueError(f"form must be one of {FORMATS}, got {form!r}")
    user = f"{task.instruction}\n\n{CONTEXT}\n\n{task.question}"
    if form == "chat":
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                                 tokenize=False, add_generation_prompt=True)
    else:
        rendered = user + "\n"
    before, after = rendered.split(CONTEXT)
    after += task.lead_in
    # the answer's tokens grown piece by piece, each prefix tokenizing as it does whole
    ids, scored, text = tokens(tokenizer, after), [], after
    for i, piece in enumerate(task.pieces):
        text += piece
        longer = tokens(tokenizer, text)
        if longer[:len(ids)] != ids:
            raise ValueError(f"the answer {task.answer!r} does not tokenize apart from its "
                             f"lead-in {task.lead_in!r} and between its pieces")
        scored += [i % 2 == 0] * (len(longer) - len(ids))
        ids = longer
    prompt_len = len(ids) - len(scored)
    return tokens(tokenizer, before), ids[:prompt_len], ids[prompt_len:], scored


def make_item(tokenizer, haystack: Haystack, task_name: str, length: int, seed,
              form: str = "chat") -> Item:
    """Item `seed` (an int or a tuple of ints) of task `task_name`: the task's facts at
    distinct random line starts of a window of the haystack (itself from a random line
    start with room for them), sized so that the prompt and the answer are `length`
    tokens together."""
    if task_name not in TASKS:
        raise ValueError(f"task_name must be one of {sorted(TASKS)}, got {task_name!r}")
    seed = (seed,) if isinstance(seed, int) else tuple(seed)
    rng = np.random.default_rng(seed)
    task = TASKS[task_name](rng)
    before, after, answer, scored = frame(tokenizer, task, form)
    facts = [tokens(tokenizer, f + "\n") for f in task.facts]
    room = length - len(before) - len(after) - len(answer) - sum(map(len, facts))
    starts = haystack.line_starts
    # line starts strictly inside each candidate window (start, start + room)
    inside = np.searchsorted(starts, starts + room) - np.arange(1, starts.size + 1)
    fits = (starts + room <= len(haystack.tokens)) & (inside >= len(facts))
    if room <= 0 or not fits.any():
        raise ValueError(f"length {length} leaves {room} tokens of text: no window of the "
                         f"haystack ({len(haystack.tokens)} tokens) that long has "
                         f"{len(facts)} line starts for the facts")
    start = int(rng.choice(starts[fits]))
    lines = starts[(starts > start) & (starts < start + room)]
    cuts = np.sort(rng.choice(lines, len(facts), replace=False)).tolist()
    context, last = [], start
    for cut, fact in zip(cuts, facts):
        context += haystack.tokens[last:cut] + fact
        last = cut
    context += haystack.tokens[last:start + room]
    return Item(task_name, seed, before + context + after, answer, scored, task.answer,
                task.facts)


def items(tokenizer, haystack: Haystack, task_name: str, length: int, count: int,
          seed: int = 0, form: str = "chat") -> list[Item]:
    """`count` items of a task, item i from the seed (seed, the task's index in TASKS,
    i)."""
    if task_name not in TASKS:
        raise ValueError(f"task_name must be one of {sorted(TASKS)}, got {task_name!r}")
    index = list(TASKS).index(task_name)
    return [make_item(tokenizer, haystack, task_name, length, (seed, index, i), form)
            for i in range(count)]


def solved(tokenizer, item: Item, predicted) -> bool:
    """Whether the teacher-forced predictions solve an item: at every scored answer token,
    the predicted token (int ids `[len(item.answer)]`, the most likely next token where
    that answer token stands) spells the start of the answer's text from there: the
    answer's own token or a shorter one (a made-up word tokenizes more than one way).
    Tokens of the format between the scored pieces are not checked."""
    predicted = [int(p) for p in predicted]
    if len(predicted) != len(item.answer):
        raise ValueError(f"predicted has {len(predicted)} tokens, the answer "
                         f"{len(item.answer)}")
    for i, (token, scored) in enumerate(zip(predicted, item.scored)):
        spelled = tokenizer.decode([token])
        rest = tokenizer.decode(item.answer[i:])
        if scored and not (spelled and rest.startswith(spelled)):
            return False
    return True
