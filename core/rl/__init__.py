"""RL post-training on the controller: advantages, the KL coefficient, rewards. Plain numbers
(numpy): the controller never imports torch. The losses that run on the workers are in
core.model.gpt.rl_loss."""
