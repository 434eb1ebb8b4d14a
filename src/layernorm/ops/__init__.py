"""torch.library custom ops with analytic backward: one module per op family."""
