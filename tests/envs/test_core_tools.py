import pytest

from skyrl_core.tools import Tool, ToolBox, ToolUnavailable, find_tag_calls, last_tag_content


def test_tag_calls_are_found_in_order_with_their_spans():
    text = "think <sql>SELECT 1</sql> then <SEARCH> cats </search> and <sql>SELECT 2"
    calls = find_tag_calls(text, ["sql", "search"])
    assert [(c.name, c.argument, c.closed) for c in calls] == [
        ("sql", "SELECT 1", True), ("search", "cats", True), ("sql", "SELECT 2", False)]
    assert text[calls[0].start:calls[0].end] == "<sql>SELECT 1</sql>"
    assert find_tag_calls("no tags <sqlx>1</sqlx>", ["sql"]) == []
    assert last_tag_content("<answer>a</answer><answer>b</answer>", "answer") == "b"
    assert last_tag_content("nothing", "answer") is None


def test_a_toolbox_runs_the_first_call_and_turns_errors_into_text():
    def explode(argument):
        raise KeyError(argument)

    box = ToolBox([Tool(name="echo", description="repeat", run=lambda a: a.upper()),
                   Tool(name="explode", description="fail", run=explode)])
    assert box.describe() == "<echo>...</echo>: repeat\n<explode>...</explode>: fail"
    assert box.execute(box.first_call("x <echo>hi</echo> <explode>y</explode>")) == "HI"
    assert box.execute(box.first_call("<explode>y</explode>")) == "Error: KeyError: 'y'"
    assert box.first_call("plain text") is None


def test_an_unavailable_tool_stops_the_run():
    def unavailable(argument):
        raise ToolUnavailable("no sandbox here")

    box = ToolBox([Tool(name="python", description="run", run=unavailable)])
    with pytest.raises(ToolUnavailable, match="no sandbox here"):
        box.execute(box.first_call("<python>1</python>"))


def test_tool_names_must_be_tag_words_and_unique():
    with pytest.raises(ValueError, match="tag-like word"):
        Tool(name="my tool", description="", run=str)
    with pytest.raises(ValueError, match="two tools are named 'a'"):
        ToolBox([Tool(name="a", description="", run=str), Tool(name="a", description="", run=str)])
