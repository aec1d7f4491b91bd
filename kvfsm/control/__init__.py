"""The sans-IO control plane: managers, tiers and the scheduler half. No torch, no I/O."""
