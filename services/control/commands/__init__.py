"""Operator commands against a running run: the ops state actor and how a command joins the run's Ray cluster
(``ops``, ``ray_connection``), live reward swaps (``reward_swaps``) and ``gyre status`` (``status``)."""
