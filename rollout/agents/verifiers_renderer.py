"""A ``renderers`` renderer for any chat template that extends a conversation without re-rendering sampled tokens.

verifiers' train client renders each turn's prompt with a ``renderers`` renderer. For models the package has no
hand-written renderer for (SmolLM2, most fine-tunes) it falls back to ``DefaultRenderer``, which re-renders the whole
transcript every turn: the model's earlier turns are decoded to text and tokenised again, which is not always the
tokens that were sampled (a cut turn, a token sequence that does not survive decode → encode). gyre breaks such
episodes rather than train on tokens that were never sampled (``rollout.agents.verifiers_env.assemble``).

``TemplateBridgeRenderer`` is that ``DefaultRenderer`` (``apply_chat_template`` for the first prompt, the same
parsing) plus ``bridge_to_next_turn``: the next prompt is the previous prompt + the sampled ids + the template's own
rendering of the new (tool / user) messages, found by diffing the chat template (``rollout.agents.episode.TurnRenderer``,
the same rule gyre's own environments use). verifiers then sends prompts that extend the context by construction.
It is what ``rollout.verifiers`` uses unless the recipe names another renderer (``rollout.verifiers.renderer``).
"""

from __future__ import annotations

from renderers.base import RenderedTokens, extract_message_tool_names
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

from gyre.rollout.agents.episode import TurnRenderer

IMPORT_PATH = "gyre.rollout.agents.verifiers_renderer.TemplateBridgeRenderer"
"""``renderers``' ``CustomRendererConfig.import_path`` of this renderer."""


class TemplateBridgeRenderer(DefaultRenderer):
    """``DefaultRenderer`` with a token-exact bridge for chat templates that ``TurnRenderer`` can diff.

    Args:
        tokenizer: the policy's HF tokenizer (a fast tokenizer: the bridge attributes tokens to messages by character
            offsets).
        config: ``DefaultRendererConfig`` (``tool_parser``, ``reasoning_parser``, template kwargs).
    """

    config_class = DefaultRendererConfig

    def __init__(self, tokenizer, config: DefaultRendererConfig | None = None) -> None:
        super().__init__(tokenizer, config)
        try:
            self._turns: TurnRenderer | None = TurnRenderer(tokenizer)
        except ValueError:  # a template that cannot be diffed: every turn is re-rendered (and checked by gyre)
            self._turns = None

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list, *, tools=None) -> RenderedTokens | None:
        """``previous_prompt_ids + previous_completion_ids + O``, ``O`` = the end token if the completion was cut,
        the template's text after it, ``new_messages`` rendered and the next assistant header; ``None`` (the
        caller re-renders) for assistant messages, non-text content, or a template that cannot be diffed.

        Attribution (``renderers``' bridge contract): ``message_indices`` ``-1`` over the previous ids and the
        scaffold, ``i`` over the tokens whose text comes from ``new_messages[i]``'s rendering; ``sampled_mask`` all
        False; ``is_content`` empty (not provided, as for ``DefaultRenderer``)."""
        if self._turns is None or not new_messages:
            return None
        if any(m.get("role") == "assistant" or not isinstance(m.get("content", ""), str) for m in new_messages):
            return None
        messages = [dict(m) for m in new_messages]
        closed = bool(previous_completion_ids) and previous_completion_ids[-1] == self._turns.end_id
        try:
            ext, owners = self._extension(messages, closed)
        except ValueError:
            return None
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        return RenderedTokens(
            token_ids=prior + ext, message_indices=[-1] * len(prior) + owners,
            sampled_mask=[False] * (len(prior) + len(ext)), is_content=[],
            message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=extract_message_tool_names(messages))

    def _extension(self, messages: list[dict], closed: bool) -> tuple[list[int], list[int]]:
        """The extension's ids (``TurnRenderer.observation_ids``) and which of ``messages`` each comes from
        (``-1``: scaffold): the message whose rendering holds the token's first character."""
        text = self._turns.observation_text(messages, closed)
        spans = self._turns.message_spans(messages, closed)
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        owners = [next((i for i, (a, b) in enumerate(spans) if a <= s < b), -1) for s, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), owners
