"""The special tokens kiln itself relies on, defined once (the chat tokens: kiln.chat.tokens)."""

# GPT-2's end-of-text token: it ends every document in a token stream, and a line holding only
# it separates documents in a .txt corpus. Every module that needs the text imports it from here.
EOT = "<|endoftext|>"
