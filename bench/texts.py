"""Real text for the quality benchmarks, from what every machine already holds, and the
passkey prompts built on it.

- "python-docs": Python's own documentation, the topics `help()` shows
  (`pydoc_data.topics`, in the standard library of every CPython), in sorted order.
- "licenses": Debian's license texts (`/usr/share/common-licenses`), in sorted order.

Both are deterministic for a given Python version and Debian release; the records name
the version. Neither was written for this project.
"""

from __future__ import annotations

import pathlib

LICENSES = pathlib.Path("/usr/share/common-licenses")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def python_docs() -> str:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[name].strip() for name in sorted(topics.topics))


def licenses(root: pathlib.Path = LICENSES) -> str:
    """The license texts (regular files only: the symbolic links repeat them)."""
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no license texts in {root}")
    return "\n\n".join(p.read_text(errors="replace").strip() for p in files)


TEXTS = {"python-docs": python_docs, "licenses": licenses}


def text_tokens(tokenizer, name: str, length: int) -> list[int]:
    """The first `length` tokens of text `name` (ValueError where it has fewer)."""
    ids = tokenizer(TEXTS[name]())["input_ids"]
    if len(ids) < length:
        raise ValueError(f"text {name!r} has {len(ids)} tokens, fewer than {length}")
    return ids[:length]


def passkey_prompt(tokenizer, haystack: list[int], depth: float, key: int,
                   length: int) -> tuple[list[int], list[int]]:
    """A prompt and its answer, `length` tokens together: the haystack's tokens with the
    needle (NEEDLE with `key`) inserted at `depth` (a share of the haystack, in [0, 1]),
    then QUESTION, then the answer " {key}" as the model writes it. A length that is a
    multiple of the block size puts the question and the answer in the last query block.

    Returns `(prompt, answer)`: token ids.
    """
    needle = tokenizer(NEEDLE.format(key=key))["input_ids"]
    question = tokenizer(QUESTION)["input_ids"]
    answer = tokenizer(f" {key}")["input_ids"]
    room = length - len(needle) - len(question) - len(answer)
    if room <= 0 or len(haystack) < room:
        raise ValueError(f"a {length}-token prompt needs {room} haystack tokens, "
                         f"got {len(haystack)}")
    cut = round(depth * room)
    prompt = haystack[:cut] + needle + haystack[cut:room] + question
    return prompt, answer
