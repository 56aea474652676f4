"""Reading YAML that may be hostile: bounded size, nesting and alias expansion.

A config is small. PyYAML's safe loader runs no code, but a 1 KB file of nested aliases (the
"billion laughs") expands to millions of values when walked, deep nesting exhausts the stack, and
a 5000-digit integer raises from inside the parser. Here each of those is a ``YAMLLimitError``
with one sentence saying what was exceeded.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_VALUES = 100_000  # values after expanding every alias


class YAMLLimitError(ValueError):
    """The document exceeds a limit (size, nesting, alias expansion, number size)."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"is nested more than {MAX_DEPTH} levels deep (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` stands for once every alias in it is copied out (memoised, so the
    count itself is cheap however large the expansion)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise YAMLLimitError("has an alias inside the node it refers to (a recursive structure)")
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, sizes, open_nodes) + _expanded_size(v, sizes, open_nodes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, sizes, open_nodes) for v in node.value)
    else:
        size = 1
    open_nodes.discard(key)
    sizes[key] = size
    if size > MAX_VALUES:
        raise YAMLLimitError(f"expands to more than {MAX_VALUES} values (through aliases *name); a config is far smaller")
    return size


def load_bounded(text: str) -> Any:
    """``yaml.safe_load(text)`` within the limits; ``YAMLLimitError`` or ``yaml.YAMLError`` otherwise."""
    if len(text) > MAX_BYTES:
        raise YAMLLimitError(f"is larger than {MAX_BYTES // (1024 * 1024)} MiB; a config is far smaller")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set())
        try:
            return loader.construct_document(node)
        except ValueError as exc:  # int("5000 digits") past Python's digit limit, and the like
            raise YAMLLimitError(f"holds a value that cannot be read ({str(exc).split(';')[0]})") from None
    finally:
        loader.dispose()
