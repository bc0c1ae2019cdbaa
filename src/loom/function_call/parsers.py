"""Choosing the ``tool_call_parser``: by name, or ``auto`` from the model's chat template."""

from __future__ import annotations

import logging

from loom.function_call.base import IdFactory, ToolCallParser, new_call_id

logger = logging.getLogger(__name__)

FAMILY = "tool_call_parser"
AUTO = "auto"


def _classes() -> list[tuple[str, type[ToolCallParser]]]:
    """Registered parser classes (a factory cannot say what templates it reads, so it is left
    out of ``auto``; so is a plug-in that fails to import)."""
    from loom import plugins

    out = []
    for name in plugins.names(FAMILY):
        try:
            target = plugins.resolve(FAMILY, name)
        except plugins.RegistryError as e:
            logger.warning("tool_call_parser %r is left out of auto: %s", name, e)
            continue
        if isinstance(target, type):
            out.append((name, target))
    return out


def parser_scores(template: str) -> list[tuple[int, str]]:
    """(score, name) of every registered parser that recognises ``template``, best first
    (equal scores in registration order)."""
    scores = []
    for name, cls in _classes():
        score = cls.template_score(template)
        if score is not None:
            scores.append((score, name))
    return sorted(scores, key=lambda s: -s[0])


def parser_for_template(template: str | None) -> str | None:
    """The registered parser whose format the chat template's source shows, or None."""
    scores = parser_scores(template) if template else []
    return scores[0][1] if scores else None


def make_tool_call_parser(
    name: str, chat_template: str | None = None, id_factory: IdFactory = new_call_id
) -> ToolCallParser:
    """The parser ``--tool-call-parser NAME`` selects; ``auto`` reads ``chat_template``.
    Raises ``ValueError`` saying what to pass when ``auto`` recognises nothing, and
    ``loom.plugins.RegistryError`` (listing the registered names) for an unknown name."""
    from loom import plugins

    if name == AUTO:
        found = parser_for_template(chat_template)
        if found is None:
            raise ValueError(no_parser_message(chat_template))
        name = found
    return plugins.resolve(FAMILY, name)(id_factory=id_factory)


def no_parser_message(chat_template: str | None) -> str:
    """Why ``auto`` found no parser, what it looked for, and what to do."""
    from loom import plugins

    what = (
        "the model has no chat template"
        if not chat_template
        else "its chat template shows no tool-call format Loom knows"
    )
    looked = "; ".join(
        f"{name}: {' or '.join(map(repr, cls.template_signals))}"
        for name, cls in _classes()
        if cls.template_signals
    )
    return (
        f"--tool-call-parser auto: {what} (looked for {looked}); name the model's format "
        f"with --tool-call-parser {{{','.join(plugins.names(FAMILY))}}}"
    )
