"""adaclip_flower: user-level DP federated training on Flower with the package's clipping.

- :class:`ServerSideClipping` — a Flower strategy wrapper: Poisson-samples users, clips each
  user's model update in the clipping strategy's transformed space (flat, per-layer, AdaCliP
  and its options), sums, adds noise once, applies the fixed- or clipped-denominator
  estimator, hands the result to the wrapped strategy as server optimizer, and accounts
  user-level ε per round;
- :class:`ClientSideClipping` with :func:`adaclip_mod` — the same with clipping and noise
  shares on the clients (secure-aggregation compatible);
- :mod:`adaclip_flower.aggregation` — the NumPy reference of one round's release;
- :mod:`adaclip_flower.torch_client` — PyTorch clients: local epochs, random rehearsal.

Needs ``flwr`` (``pip install "adaclip[flower]"``).
"""

from adaclip_flower.aggregation import UserLevelMechanism, aggregate_updates
from adaclip_flower.mods import adaclip_mod
from adaclip_flower.server import ClientSideClipping, ServerSideClipping

__all__ = ["ClientSideClipping", "ServerSideClipping", "UserLevelMechanism", "adaclip_mod", "aggregate_updates"]
