"""The learner service: its Ray actors (rank 0 and the other ranks), their placement group, the weight server."""
