"""Two custom objectives to copy: ``advantages.batch_loo`` (REINFORCE with a leave-one-out baseline over the
whole batch) and ``losses.clipped_is_pg`` (a policy gradient with a truncated, stop-gradient importance weight).
The tensor contract they follow is ``learner.objectives``; ``README.md`` says how a recipe names them."""
