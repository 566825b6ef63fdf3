"""User-level DP-FedAvg of a next-word LSTM on Flower (the ``lm-users`` task)."""
