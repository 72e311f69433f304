"""Ground-level helpers every part of gyre may import (and that import nothing of gyre's but each other):
durable file commits (``durable``), retry and reconnect policies (``retry``), where a model's weights come from
(``model_source``) and how a recipe names a user's Python callable (``callable_spec``)."""
