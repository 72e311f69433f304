"""Running a recipe: the controller (Ray driver), supervisor, service factory, ops state, recipe and placement
configs, the plan, evaluations, progress line and run outputs."""
