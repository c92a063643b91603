"""Questions into prompt token ids: the tokenizer's chat template, or a plain-text template.

Three ways a question becomes a prompt (`build_prompt_ids`):

* the tokenizer's chat template (the default): ``[system?, user]`` messages with the assistant turn
  opened; ``chat_template_kwargs`` go to the template (Qwen3's ``{"enable_thinking": false}``);
* a plain-text ``template`` instead of any chat template, for base models and "Zero" RL recipes
  (R1-Zero, SimpleRL, Dr.GRPO's Qwen-Math prompt): ``{question}`` and ``{system_prompt}`` are
  replaced, nothing else is interpreted (LaTeX braces stay as written);
* a tokenizer without a chat template and no ``template``: ``"system\\n\\nquestion\\n"`` (warned once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

_FIELDS = re.compile(r"\{(question|system_prompt)\}")
# apply_chat_template's own arguments: a chat_template_kwargs entry must not replace them
_RESERVED_CHAT_KWARGS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "tools",
                                   "documents", "chat_template", "return_dict", "return_tensors", "tokenizer_kwargs"})

_warned_no_template = False
_warned_folded_system_prompt = False
_warned_unused_system_prompt = False


def check_prompt_format(template: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> None:
    """One-line errors for a template that cannot work, named by their ``data.*`` keys."""
    if template is not None:
        if not isinstance(template, str) or "{question}" not in template:
            raise ValueError(f"data.prompt_template must be text containing {{question}}, got {template!r}")
        if chat_template_kwargs:
            raise ValueError("data.chat_template_kwargs go to the tokenizer's chat template, which "
                             "data.prompt_template replaces: set one of them")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise ValueError(f"data.chat_template_kwargs must map names to values, got {chat_template_kwargs!r}")
        reserved = sorted(_RESERVED_CHAT_KWARGS & set(chat_template_kwargs))
        if reserved:
            raise ValueError(f"data.chat_template_kwargs cannot set {', '.join(reserved)} (the prompt builder does)")


def prompt_format_digest(system_prompt: str | None, template: str | None,
                         chat_template_kwargs: Mapping[str, Any] | None) -> str:
    """12 hex digits that change with anything that changes the prompts' text (kept in checkpoints)."""
    text = json.dumps([system_prompt or None, template, dict(chat_template_kwargs or {})], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def fill_template(template: str, question: str, system_prompt: str | None) -> str:
    """``template`` with ``{question}`` and ``{system_prompt}`` replaced in one pass (a question that
    itself contains ``{system_prompt}`` stays as written)."""
    values = {"question": question, "system_prompt": system_prompt or ""}
    return _FIELDS.sub(lambda m: values[m.group(1)], template)


def _messages(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": question}]


def _to_id_lists(encoded: Any) -> list[list[int]]:
    """Normalise apply_chat_template/tokenizer output (list, nested list, BatchEncoding, tensor)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    encoded = list(encoded)
    if not encoded or isinstance(encoded[0], int):
        return [[int(t) for t in encoded]]
    return [[int(t) for t in ids] for ids in encoded]


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _warn_once(flag: str, message: str, *args: Any) -> None:
    if not globals()[flag]:
        globals()[flag] = True
        logger.warning(message, *args)


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    return _to_id_lists(tokenizer(text)["input_ids"])[0]


def build_prompt_ids(tokenizer: Any, question: str, system_prompt: str | None, *, template: str | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of one question's prompt (see the module docstring for the three ways).

    ``system_prompt`` None or empty means no system message. With a ``template`` the text is
    tokenized as is (the tokenizer adds its BOS where it always does, e.g. Llama's).
    """
    if template is not None:
        if system_prompt and "{system_prompt}" not in template:
            _warn_once("_warned_unused_system_prompt", "data.prompt_template has no {system_prompt}: data.system_prompt "
                       "is not in the prompts (set it to null to silence this; the accuracy reward looks for a "
                       "\\boxed{} answer first, so ask for one in the template)")
        return _plain_ids(tokenizer, fill_template(template, question, system_prompt))
    if not getattr(tokenizer, "chat_template", None):
        _warn_once("_warned_no_template", "tokenizer %s has no chat template; prompts are plain text "
                   "'system\\n\\nquestion\\n' (data.prompt_template sets your own)", _name(tokenizer))
        text = f"{system_prompt}\n\n{question}\n" if system_prompt else f"{question}\n"
        return _plain_ids(tokenizer, text)
    from jinja2.exceptions import TemplateError

    def render(messages: list[dict[str, str]]) -> list[int]:
        return _to_id_lists(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          **dict(chat_template_kwargs or {})))[0]

    try:
        return render(_messages(question, system_prompt))
    except TemplateError as err:  # Gemma's, Mistral-Instruct v0.1's templates raise on a system turn
        if not system_prompt:
            raise ValueError(f"the tokenizer's chat template failed on a user message: {err}") from err
        _warn_once("_warned_folded_system_prompt", "the chat template of %s refuses a system message (%s): "
                   "data.system_prompt is put at the start of the user message instead (set data.system_prompt: "
                   "null for none)", _name(tokenizer), err)
        return render(_messages(f"{system_prompt}\n\n{question}", None))


def encode_prompts(
    tokenizer: Any,
    examples: Sequence[Any],
    system_prompt: str | None,
    max_prompt_length: int | None = None,
    *,
    template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[Any], list[list[int]], int]:
    """`build_prompt_ids` for every example (anything with a ``prompt``), dropping prompts longer than
    ``max_prompt_length`` tokens. Returns ``(kept_examples, kept_prompt_ids, num_dropped)`` in order."""
    kept: list[Any] = []
    kept_ids: list[list[int]] = []
    for ex in examples:
        ids = build_prompt_ids(tokenizer, ex.prompt, system_prompt, template=template,
                               chat_template_kwargs=chat_template_kwargs)
        if max_prompt_length is None or len(ids) <= max_prompt_length:
            kept.append(ex)
            kept_ids.append(ids)
    return kept, kept_ids, len(examples) - len(kept)
