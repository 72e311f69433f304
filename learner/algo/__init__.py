"""The RL algorithm's math, pure torch: no state, no distributed code.

- ``advantages``: the advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++, GAE, outcome);
- ``losses``: the policy loss (PPO clip, TIS / MIS importance weights), KL penalty, entropy, value loss and
  their aggregation (``loss_agg_mode``);
- ``objectives`` / ``objective_check``: a user's own objective in place of the policy loss, and its contract check;
- ``kl_control``: the adaptive or fixed KL coefficient;
- ``logprobs``: ``token_logprobs``.
"""
