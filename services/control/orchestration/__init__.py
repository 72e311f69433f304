"""Running a recipe: the controller (Ray driver) and its supervisor, how services are created and placed
(``factory``, ``placement``, ``topology``), the deaths and replacements it records (``incarnations``), held-out
evaluation during the run (``evaluation``), its progress line and the fleet's rollout time per step."""
