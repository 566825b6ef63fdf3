"""User-level DP-FedAvg on Flower: simulated users learn to read scikit-learn's digits together."""
