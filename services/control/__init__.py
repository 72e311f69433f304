"""Running a recipe, in four rooms: ``recipe/`` (load and validate it), ``orchestration/`` (the controller, its
supervisor and the services it starts), ``commands/`` (operating a running run) and ``outputs/`` (what a run
writes to its directory)."""
