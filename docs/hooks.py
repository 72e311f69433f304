"""mkdocs hook: fills the ``<!-- generated:NAME -->`` markers of the reference pages from the code
(``services.cli.reference_docs``), so the recipe and CLI references and the custom-objective contract always
match the installed gyre."""

from __future__ import annotations

from gyre.services.cli.reference_docs import cli_reference, objectives_reference, recipe_reference

GENERATORS = {"<!-- generated:recipe -->": recipe_reference, "<!-- generated:cli -->": cli_reference,
              "<!-- generated:objectives -->": objectives_reference}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' hook signature)
    for marker, render in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
