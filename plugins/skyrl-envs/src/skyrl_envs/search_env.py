"""``search``: question answering with a ``<search>`` tool over a local index.

Each turn the model either searches, ``<search>query</search>`` (it is shown the ``top_k`` best
passages, inside ``<information>...</information>``, as the next user message), or answers, ``<answer>text</answer>``: reward 1.0 when the
answer matches one of ``reward_spec.ground_truth`` (a string, a list, or ``{"target": ...}``)
after SQuAD normalisation, else 0.0. A turn with neither gets a reminder; after ``max_turns``
turns without an answer, reward 0.0.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.tools import Tool, ToolBox, find_tag_calls
from skyrl_core.types import Message, StepResult
from skyrl_envs.base import EpisodeEnv, ground_truth, prompt_messages
from skyrl_envs.qa import accepted_answers, exact_match
from skyrl_envs.search_index import SHIPPED_CORPUS, SearchIndex, shared_index

INSTRUCTIONS = (
    "Answer the question. You can search a document collection by writing <search>your query</search>; "
    "the best passages will be shown to you. Search as often as you need, then give a short final answer "
    "as <answer>...</answer>."
)

SEARCH_QUESTIONS = [
    ("What is the chemical symbol of silver?", ["Ag"]),
    ("What is the atomic number of gold?", ["79"]),
    ("Which planet has the moons Phobos and Deimos?", ["Mars"]),
    ("In what year was Neptune discovered?", ["1846"]),
    ("What is the capital of Australia?", ["Canberra"]),
    ("Who invented the World Wide Web?", ["Tim Berners-Lee", "Berners-Lee"]),
    ("What is the deepest lake in the world?", ["Lake Baikal", "Baikal"]),
    ("Who discovered penicillin?", ["Alexander Fleming", "Fleming"]),
    ("In which city did Gutenberg introduce printing with movable type?", ["Mainz"]),
    ("What is the largest moon of Saturn?", ["Titan"]),
    ("Which European river rises in the Black Forest?", ["Danube"]),
    ("Who created the Python programming language?", ["Guido van Rossum", "van Rossum"]),
]


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"search option {attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class SearchOptions:
    corpus_path: str = attrs.field(default=str(SHIPPED_CORPUS), metadata={"help": "JSONL corpus of passages", "path": "input"})
    index_dir: str = attrs.field(default="", metadata={"help": "where the index is built ('' = $SKYRL_CACHE_DIR/search)", "path": "output"})
    top_k: int = attrs.field(default=3, validator=_positive, metadata={"help": "passages returned per search"})
    max_turns: int = attrs.field(default=4, validator=_positive, metadata={"help": "turns before the episode ends"})
    max_passage_chars: int = attrs.field(default=600, validator=_positive, metadata={"help": "passages are cut to this"})


def format_passages(passages: list[tuple[str, str]], limit_chars: int) -> str:
    if not passages:
        return "<information>No passage matches that query.</information>"
    docs = "\n".join(f"Doc {i} (Title: {title}) {text[:limit_chars]}" for i, (title, text) in enumerate(passages, 1))
    return f"<information>\n{docs}\n</information>"


def search_tool(index: SearchIndex, top_k: int, limit_chars: int) -> Tool:
    """The ``<search>`` tool over ``index`` (shared by ``search`` and ``multi_tool``)."""
    return Tool(name="search", description=f"search the documents; shows the {top_k} best passages",
                run=lambda query: format_passages(index.search(query, top_k), limit_chars))


def question_rows(questions: list[tuple[str, list[str]]], instructions: str, env_class: str) -> list[dict[str, Any]]:
    """``(question, accepted answers)`` pairs as ``env_class`` dataset rows: ``instructions`` as the
    system message, the question as the user's, the answers as ``{"target": [...]}``."""
    return [
        {
            "prompt": [{"role": "system", "content": instructions}, {"role": "user", "content": question}],
            "env_class": env_class,
            "reward_spec": {"ground_truth": {"target": answers}},
            "extra_info": {"index": index},
        }
        for index, (question, answers) in enumerate(questions)
    ]


def search_rows() -> list[dict[str, Any]]:
    """The shipped questions over the shipped corpus as ``search`` dataset rows."""
    return question_rows(SEARCH_QUESTIONS, INSTRUCTIONS, "search")


class SearchEnv(EpisodeEnv):
    """The ``search`` environment; ``multi_tool`` extends it with more tools and another answer check."""

    options_class = SearchOptions
    name = "search"
    no_tool_call = ("No <search> or <answer> found. Write <search>query</search> to search, "
                    "or <answer>...</answer> to answer.")

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.index = shared_index(self.options.corpus_path, self.options.index_dir or None)
        self._tools = ToolBox(self.tools())

    def tools(self) -> list[Tool]:
        """The tools the model may call (built once per environment)."""
        return [search_tool(self.index, self.options.top_k, self.options.max_passage_chars)]

    def is_correct(self, predicted: str) -> bool:
        """Whether ``<answer>predicted</answer>`` earns reward 1.0."""
        return exact_match(predicted, self._answers)

    def start(self, sample: dict[str, Any]) -> list[Message]:
        self._answers = accepted_answers(ground_truth(sample, self.name))
        return prompt_messages(sample, self.name)

    def judge(self, action_text: str) -> StepResult:
        answers = find_tag_calls(action_text, ["answer"])
        if answers:
            predicted = answers[-1].argument
            return self.finish(1.0 if self.is_correct(predicted) else 0.0, answer=predicted)
        if self.turn >= self.options.max_turns:
            return self.finish(0.0, reason="max_turns")
        call = self._tools.first_call(action_text)
        if call is None:
            return self.observe(self.no_tool_call, reason="no_tool_call")
        return self.observe(self._tools.execute(call), reason=call.name)
