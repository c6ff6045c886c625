"""Post-training: supervised fine-tuning (`sft/`), preference and RL training (`align/`), and
what they share: the checkable instruction tasks (`tasks`) and their data (`chat_data`), replies
through the engine (`replies`, `kiln chat` in `chat_session`), `add_chat_tokens`, output folders.

The chat format itself (tokens, renderer, template export) is `kiln.chat`.
"""
