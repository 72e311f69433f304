"""The learner's checkpoint tier: what a step's state becomes on disk and how a run resumes from it.

- ``store``: the on-disk format and its commit protocol (temp dir, fsync, rename), verification, pruning,
  resume selection and the RNG state;
- ``engine``: saving and loading a DeepSpeed engine through it (``SnapshotCheckpointEngine`` for async saves);
- ``request``: what one save asks for (``CheckpointRequest``) and the commit every engine shares;
- ``async_save``: the background writer of an asynchronous save;
- ``cycle``: when the learner loop saves, mirrors, archives and prunes;
- ``mirror`` / ``archive`` / ``archive_uploads`` / ``crypto``: the second local copy, the object-store copy
  (fsspec, optionally AES-256-GCM encrypted) and its upload queue;
- ``reshard``: resuming under another data-parallel size (DeepSpeed universal checkpoints);
- ``spike``: shortening the save interval after a loss spike.
"""
