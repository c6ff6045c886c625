"""Post-training: chat format, SFT, LoRA, preference optimisation (DPO) and RL (PPO, GRPO)."""
