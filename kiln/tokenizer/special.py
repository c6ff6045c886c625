"""The special tokens kiln itself relies on, defined once."""

# GPT-2's end-of-text token: it ends every document in a token stream, and a line holding only
# it separates documents in a .txt corpus. Every module that needs the text imports it from here.
EOT = "<|endoftext|>"

# The chat format's role and control tokens (DESIGN.md, "Chat format"): each message is its role
# token, its text, then END; a reply is generated after ASSISTANT and stops at END.
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END)
