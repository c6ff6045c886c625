"""The special tokens kiln itself relies on, defined once: end-of-text and the chat format's."""

# GPT-2's end-of-text token: it ends every document in a token stream, and a line holding only
# it separates documents in a .txt corpus. Every module that needs the text imports it from here.
EOT = "<|endoftext|>"

# The chat format's role and control tokens (their meaning: kiln.chat). Here, beside EOT, so the
# tokenizer's own command can reserve them (`kiln tokenizer train --chat`) without importing chat.
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END)
