"""The chat format, in one place for post-training, serving and export.

`tokens`: the role and control tokens; `template`: a tokenizer's chat template (the tokens' ids,
the Jinja layout for `tokenizer_config.json`); `render`: a conversation to ids and loss mask;
`conversations`: JSON-lines conversation files; `api_messages`: chat API requests to prompt ids.
It sits above the tokenizer and imports nothing else of kiln but the base modules.
"""

from kiln.chat.conversations import iter_conversations
from kiln.chat.render import RenderedChat, check_conversation, render, render_text
from kiln.chat.template import (
    JINJA_TEMPLATE,
    ChatTemplate,
    chat_template_of,
    require_chat_template,
)
from kiln.chat.tokens import CHAT_TOKENS, ROLES

__all__ = [
    "CHAT_TOKENS",
    "JINJA_TEMPLATE",
    "ROLES",
    "ChatTemplate",
    "RenderedChat",
    "chat_template_of",
    "check_conversation",
    "iter_conversations",
    "render",
    "render_text",
    "require_chat_template",
]
