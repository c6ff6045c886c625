"""Supervised fine-tuning (`kiln sft`): the run (`run`), LoRA adapters (`lora`) and conversation
rows packed for the trainer (`packing`)."""
