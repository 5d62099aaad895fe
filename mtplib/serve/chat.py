"""A conversation as the prompt text the model expects (`render_chat`): upstream's
built-in format where one was chosen (--chat-template NAME, --no-jinja), else the chat
template (Jinja in a sandbox, as llama-cpp-python renders it), else ChatML.

Why a sandbox: the template comes from the GGUF file, data the service did not write; an
immutable sandboxed environment keeps a template from reaching the process."""

from __future__ import annotations

from collections.abc import Sequence

from mtplib.serve.config import ServeConfig
from mtplib.serve.errors import ApiError
from mtplib.serve.protocol import ChatMessage

#: ChatML, llama-server's template for a model whose GGUF has none (the trained pair)
CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


def render_chat(cfg: ServeConfig, messages: Sequence[ChatMessage]) -> str:
    """The prompt text of a conversation; the assistant's turn is opened. A template that
    refuses the messages (its raise_exception) or fails on them is a 400."""
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    if cfg.chat_format is not None:  # upstream's built-in format (a NUL is refused)
        try:
            return cfg.chat_format(msgs)
        except ValueError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}",
                           param="messages") from None
    if cfg.chat_template is None:
        return "".join(CHATML.format(**m) for m in msgs) + "<|im_start|>assistant\n"
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(msg: str):
        raise ApiError(400, f"the model's chat template refused the messages: {msg}",
                       param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(cfg.chat_template).render(
            messages=msgs, add_generation_prompt=True, bos_token=cfg.bos_token,
            eos_token=cfg.eos_token, raise_exception=refuse)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template failed on the messages: {e}",
                       param="messages") from None
