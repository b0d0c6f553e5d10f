"""Griffe extension: read our Google-style `Example:` sections as examples.

The package's docstrings head their runnable examples `Example:` (as Keras does).
Griffe's Google parser knows only the plural, `Examples:`, as a section of code;
the singular would be rendered as a note, with the `>>>` lines as plain text. This
renames the heading in the copy griffe reads, for the API reference only.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Turns every `Example:` heading into `Examples:` before the docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
