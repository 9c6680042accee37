"""`bench.retrieval_tasks`: the items are seeded, as long as asked, and answerable from
their prompt's text alone; `solved` scores the answer's pieces, not its format. Uses the
real model's tokenizer (skips without the `models` extra and the weights)."""

from __future__ import annotations

import collections
import re

import pytest

pytest.importorskip("transformers")

from bench import retrieval_tasks as rt, smollm2, texts  # noqa: E402

TASKS = list(rt.TASKS)


@pytest.fixture(scope="module")
def tokenizer():
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    path = smollm2.gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def haystack(tokenizer):
    return rt.Haystack(tokenizer, tokenizer(texts.licenses())["input_ids"])


def context_of(tokenizer, item) -> str:
    """The prompt's text between the instruction and the question."""
    return tokenizer.decode(item.prompt).split("\n\n", 1)[1].rsplit("\n\n", 1)[0]


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_item_other_seeds_differ(tokenizer, haystack, task):
    first = rt.make_item(tokenizer, haystack, task, 1024, (3, 1))
    assert first == rt.make_item(tokenizer, haystack, task, 1024, (3, 1))
    others = [rt.make_item(tokenizer, haystack, task, 1024, (3, i)) for i in (2, 3)]
    for other in others:
        assert other.prompt != first.prompt and other.answer_text != first.answer_text
    assert rt.items(tokenizer, haystack, task, 1024, 2, seed=3)[1] == rt.make_item(
        tokenizer, haystack, task, 1024, (3, TASKS.index(task), 1))


@pytest.mark.parametrize("form", rt.FORMATS)
@pytest.mark.parametrize("length", [512, 7168])
@pytest.mark.parametrize("task", TASKS)
def test_prompt_and_answer_are_length_tokens_the_answer_last(tokenizer, haystack, task,
                                                             length, form):
    item = rt.make_item(tokenizer, haystack, task, length, 5, form)
    assert len(item.prompt) + len(item.answer) == length
    assert len(item.scored) == len(item.answer) and item.scored[0]
    whole = tokenizer.decode(item.prompt + item.answer)
    assert whole.endswith(item.answer_text) and item.answer_text.strip()
    assert whole.startswith("<|im_start|>system") == (form == "chat")
    for fact in set(item.facts):  # every fact, as often as inserted, ending its line
        assert whole.count(f"{fact}\n") == item.facts.count(fact)


@pytest.mark.parametrize("seed", range(4))
def test_multi_key_answer_is_the_asked_keys_number(tokenizer, haystack, seed):
    item = rt.make_item(tokenizer, haystack, "multi-key", 2048, seed)
    context = context_of(tokenizer, item)
    facts = re.findall(r"^[ \t]*The special magic number for (\S+) is: (\d+)\.$", context,
                       re.M)
    assert len(facts) == len(item.facts) == 4 and len(dict(facts)) == 4  # distinct keys
    asked = re.search(r"magic number for (\S+)\?", tokenizer.decode(item.prompt)).group(1)
    assert dict(facts)[asked] == item.answer_text
    assert len({n for _, n in facts}) == 4


@pytest.mark.parametrize("shape", [{}, {"hops": 3, "distractors": 3, "distractor_hops": 2}])
@pytest.mark.parametrize("seed", range(3))
def test_variable_tracking_answer_is_every_variable_holding_the_value(
        tokenizer, haystack, monkeypatch, seed, shape):
    monkeypatch.setitem(rt.TASKS, "variable-tracking",
                        lambda rng: rt.variable_tracking(rng, **shape))
    item = rt.make_item(tokenizer, haystack, "variable-tracking", 2048, seed)
    context = context_of(tokenizer, item)
    value = re.search(r"hold the value (\d+)\?", tokenizer.decode(item.prompt)).group(1)
    holds = collections.defaultdict(list)  # value or variable -> variables assigned it
    line = r"^[ \t]*(?:The value (\d+) is assigned to|VAR (\w+) is copied to) VAR (\w+)\.$"
    for number, variable, target in re.findall(line, context, re.M):
        holds[number or variable].append(target)
    found, frontier = [], [value]
    while frontier:  # the variables reached from the value, in chain order
        frontier = [v for f in frontier for v in holds[f]]
        found += frontier
    hops, distractors = shape.get("hops", 1), shape.get("distractors", 2)
    assert len(found) == hops + 1
    assert sum(key.isdigit() for key in holds) == 1 + distractors  # one value per chain
    assert sum(map(len, holds.values())) == len(item.facts) == hops + 1 + distractors * (
        shape.get("distractor_hops", 0) + 1)
    assert item.answer_text == f" {found[0]}" + "".join(
        f". VAR {a} is copied to VAR {b}" for a, b in zip(found, found[1:]))
    scored = [t for t, s in zip(item.answer, item.scored) if s]
    assert tokenizer.decode(scored) == "".join(f" {v}" for v in found)


@pytest.mark.parametrize("seed", range(4))
def test_common_words_answer_is_the_most_frequent_word(tokenizer, haystack, seed):
    item = rt.make_item(tokenizer, haystack, "common-words", 2048, seed)
    counts = collections.Counter(re.findall(r"^[ \t]*Word: (\w+)\.$",
                                            context_of(tokenizer, item), re.M))
    (top, n), (_, runner_up) = counts.most_common(2)
    assert item.answer_text == f" {top}" and n > runner_up
    assert sum(counts.values()) == len(item.facts) == 8 + 6


def test_common_words_several_answers_in_order(tokenizer, haystack, monkeypatch):
    monkeypatch.setitem(rt.TASKS, "common-words", lambda rng: rt.common_words(
        rng, counts=(9, 6, 4), distractors=5, distractor_count=2))
    item = rt.make_item(tokenizer, haystack, "common-words", 2048, 1)
    counts = collections.Counter(re.findall(r"^[ \t]*Word: (\w+)\.$",
                                            context_of(tokenizer, item), re.M))
    assert sorted(counts.values(), reverse=True) == [9, 6, 4] + [2] * 5
    top = [w for w, _ in counts.most_common(3)]
    assert item.answer_text == f" {top[0]}.\nWord: {top[1]}.\nWord: {top[2]}"


def test_solved_checks_the_scored_tokens_only(tokenizer, haystack):
    item = rt.make_item(tokenizer, haystack, "variable-tracking", 1024, 2)
    assert rt.solved(tokenizer, item, item.answer)
    given = item.scored.index(False)
    assert rt.solved(tokenizer, item, item.answer[:given] + [item.answer[0]]
                     + item.answer[given + 1:])
    digit = tokenizer("7", add_special_tokens=False)["input_ids"]
    assert not rt.solved(tokenizer, item, digit + item.answer[1:])
    # a scored token spelled shorter (its first two characters) is accepted
    i = next(i for i, (t, s) in enumerate(zip(item.answer, item.scored))
             if s and len(tokenizer.decode([t])) > 2)
    shorter = tokenizer(tokenizer.decode([item.answer[i]])[:2],
                        add_special_tokens=False)["input_ids"]
    assert len(shorter) == 1
    assert rt.solved(tokenizer, item, item.answer[:i] + shorter + item.answer[i + 1:])
    with pytest.raises(ValueError, match="predicted has"):
        rt.solved(tokenizer, item, item.answer[:-1])


def test_multi_key_digit_wrong_is_not_solved(tokenizer, haystack):
    item = rt.make_item(tokenizer, haystack, "multi-key", 1024, 0)
    digit = item.answer_text[-1]
    other = tokenizer(str((int(digit) + 1) % 10), add_special_tokens=False)["input_ids"]
    assert not rt.solved(tokenizer, item, item.answer[:-1] + other)


def test_bad_arguments_are_named(tokenizer, haystack):
    with pytest.raises(ValueError, match="task_name"):
        rt.make_item(tokenizer, haystack, "passkey", 1024, 0)
    with pytest.raises(ValueError, match="length 64"):
        rt.make_item(tokenizer, haystack, "multi-key", 64, 0)
    with pytest.raises(ValueError, match="form"):
        rt.make_item(tokenizer, haystack, "multi-key", 1024, 0, form="markdown")
    with pytest.raises(ValueError, match="counts"):
        rt.common_words(None, counts=(4, 6))
    with pytest.raises(ValueError, match="hops must be at least 1"):
        rt.variable_tracking(None, hops=0)
    with pytest.raises(ValueError, match="need 30 names"):
        rt.variable_tracking(None, hops=5, distractors=8, distractor_hops=2)
    with pytest.raises(ValueError, match="keys"):
        rt.multi_key(None, keys=0)
