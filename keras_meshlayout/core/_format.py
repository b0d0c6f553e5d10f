"""Text rendering shared by the plan, the reports and the pictures."""

from __future__ import annotations

import difflib
import io
import re
from collections.abc import Sequence
from typing import Any


def to_text(renderable: Any, width: int = 160) -> str:
    """A `rich` renderable as plain text, trailing spaces trimmed."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


#: How a notebook shows a rich renderable: monospace, as the terminal does.
_HTML = (
    "<pre style=\"font-family: Menlo, 'DejaVu Sans Mono', Consolas, monospace; line-height: 1.25; "
    'white-space: pre; overflow-x: auto">{code}</pre>'
)


def to_html(renderable: Any, width: int = 160) -> str:
    """A `rich` renderable as an HTML fragment with inline colours, for a notebook's `_repr_html_`."""
    from rich.console import Console

    console = Console(
        record=True, file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor"
    )
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format=_HTML)


class Displayed:
    """Notebook display for a value that renders with `rich` and prints as text.

    IPython and Jupyter call `_repr_html_` for a cell's value (colours, as in the terminal) and
    `_repr_pretty_` for `pretty`/the text view (the plain drawing `str` gives).
    """

    def _repr_html_(self) -> str:
        return to_html(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"<{type(self).__name__}>" if cycle else str(self))


def format_axes(axes: tuple) -> str:
    """`(None, 'model')` → `(None, model)`; `(256, 128)` → `(256, 128)`.

    A dimension split over several mesh axes shows them as a tuple:
    `(('data', 'model'), None)` → `(('data','model'), None)`.
    """
    inner = ", ".join(_entry(a) for a in axes)
    return f"({inner},)" if len(axes) == 1 else f"({inner})"


def _entry(entry: Any) -> str:
    if entry is None:
        return "None"
    if isinstance(entry, (tuple, list)):
        return "(" + ",".join(repr(str(axis)) for axis in entry) + ")"
    return str(entry)


def format_bytes(count: float) -> str:
    """Bytes in binary units: `format_bytes(1536)` → `'1.5 KiB'`."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    power = 0
    while abs(count) >= 1024 and power < len(units) - 1:
        count /= 1024
        power += 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"


def format_seconds(value: float | None) -> str:
    """`1.5 ms`, `2.3 µs`, `-` for none."""
    if value is None:
        return "-"
    scale, unit = next(((s, u) for s, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
                        if value >= s), (1e-9, "ns"))  # fmt: skip
    return f"{value / scale:.3g} {unit}"


def id_ranges(ids: Sequence[int]) -> str:
    """Device ids as text, runs collapsed: `[0, 1, 2, 3, 8]` → `'0-3, 8'` (the one format for id lists)."""
    if not ids:
        return ""
    parts: list[str] = []
    start = previous = ids[0]
    for current in [*ids[1:], None]:
        if current is not None and current == previous + 1:
            previous = current
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if current is not None:
            start = previous = current
    return ", ".join(parts)


def mesh_text(names: Sequence[str], shape: Sequence[int]) -> str:
    """`"data=2 × model=4"`."""
    return " × ".join(f"{name}={size}" for name, size in zip(names, shape, strict=True))


def did_you_mean(name: str, options: Sequence[str]) -> str:
    """`" Did you mean 'model'?"` for a close option, else `""` (to append to a message).

    Example:
        >>> did_you_mean("modle", ("data", "model")), did_you_mean("pipe", ("data", "model"))
        (" Did you mean 'model'?", '')
    """
    close = difflib.get_close_matches(str(name), [str(option) for option in options], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def unmatched_hint(pattern: str, paths: Sequence[str]) -> str:
    """What to say after "matched no variable": the nearest paths, and why when Keras renumbered them.

    Keras names an unnamed layer after its class and numbers it across the session
    (`dense`, `dense_1`, ...): rules written for one build of a model miss the same model
    built again (`dense_4`). Such a rule matches once every number is allowed.

    Example:
        >>> hint = unmatched_hint(r"(?:mlp/)?dense_1/kernel", ["mlp_1/dense_4/kernel"])
        >>> hint.split(". ")[0]
        " Nearest variable paths: 'mlp_1/dense_4/kernel'"
        >>> "built again" in hint, "built again" in unmatched_hint("head/kernel", ["mlp/head/bias"])
        (True, False)
    """
    near = nearest_paths(pattern, paths)
    hint = f" Nearest variable paths: {', '.join(map(repr, near))}." if near else ""
    try:
        any_number = re.compile(_ANY_NUMBER.sub(r"\1(?:_\\d+)?", pattern))
    except re.error:
        return hint
    renumbered = next((path for path in paths if any_number.fullmatch(path)), None)
    if renumbered is None:
        return hint
    return (
        f"{hint} Keras numbers unnamed layers across the session, and this model was built again "
        f'after the rule was written ({renumbered!r}): name the layers (`name="up"`), or plan on '
        "a model built with `kml.dry_build(build)`, which hands Keras's names back."
    )


#: A name segment of a pattern (`dense_1`, `block`) before `/`, `)` or the end, its number aside.
_ANY_NUMBER = re.compile(r"(?<![\\\w])([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z][A-Za-z0-9]*)*)(?:_\d+)?(?=/|\)|$)")


def nearest_paths(pattern: str, paths: Sequence[str], count: int = 3) -> list[str]:
    """The paths nearest a rule's pattern, its regex syntax set aside: for "matched nothing" hints.

    Example:
        >>> nearest_paths(r".*dense_1/kernal", ["mlp/dense_1/kernel", "mlp/dense_1/bias", "mlp/head/kernel"])
        ['mlp/dense_1/kernel', 'mlp/dense_1/bias']
    """
    plain = pattern.replace("(?:", " ")
    text = " ".join("".join(c if c.isalnum() or c in "/_-" else " " for c in plain).split())
    scored = sorted(
        ((difflib.SequenceMatcher(None, text, path).ratio(), path) for path in dict.fromkeys(paths)),
        key=lambda item: -item[0],
    )
    return [path for score, path in scored[:count] if score >= 0.5]
