"""The recipe: a YAML file validated into one pydantic tree (``schema``), its paths resolved before validation
(``paths``), the plan ``gyre run --dry-run`` prints (``plan``), whether this machine can run it (``machine_check``),
and a recipe whose replay trains from a recorded run (``recorded``)."""
