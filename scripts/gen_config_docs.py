"""Rewrite the generated part of docs/config.md from the schema (a test checks it is current)."""

from pathlib import Path

from skyrl_core.config.reference import config_reference

BEGIN, END = "<!-- BEGIN GENERATED REFERENCE -->", "<!-- END GENERATED REFERENCE -->"

if __name__ == "__main__":
    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{BEGIN}\n{config_reference()}\n{END}{tail}")
