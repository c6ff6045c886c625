"""Preference and RL training (`kiln dpo`, `kiln reward`, `kiln rl`, `kiln posttrain preferences`).

`run`: a run from its config (sections, run folder, resume checks); `loop`: what the three loops
share (settings, steps, checkpoints, resume); `dpo` + `dpo_loss`, `reward_model`, `rl` +
`rl_losses` + `rollout`: each loop and its arithmetic; `logprobs`: the log-probabilities they
are built from; `preferences`: pairs sampled from a chat model; `report`: the run's curves.
"""
