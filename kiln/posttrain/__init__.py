"""Post-training: the chat format and renderer, checkable tasks and their data, `kiln chat`.

`chat_format` renders conversations to ids + loss mask (the renderer itself lives in
`kiln.tokenizer.chat`, so export and the server use the same one); `tasks` holds the instruction
tasks with their program checks; `chat_data` builds conversations from TinyStories.
"""
