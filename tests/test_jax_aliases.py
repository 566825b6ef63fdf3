"""The JAX aliases pass their release keywords to ``private_aggregate`` as one typed set.

Each alias only chooses a core strategy; its release keywords (:class:`adaclip_jax.ReleaseOptions`)
are checked as a signature would check them, and then reach :func:`adaclip_jax.private_aggregate`
unchanged: the alias and ``private_aggregate`` with the alias's strategy release the same values.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import adaclip  # noqa: E402
import adaclip_jax as aj  # noqa: E402
from adaclip_jax._aliases import RELEASE_OPTION_NAMES, ReleaseOptions  # noqa: E402

RELEASE = dict(noise_multiplier=0.7, expected_batch_size=4.0, key=3, noise_mechanism="banded", bands=2)

ALIASES = {
    "flat_clip": (aj.flat_clip, dict(max_grad_norm=0.5), adaclip.FlatClipping(0.5)),
    "automatic_clip": (aj.automatic_clip, dict(max_grad_norm=0.5, stability=0.1), adaclip.AutomaticClipping(0.5, 0.1)),
    "per_layer_clip": (aj.per_layer_clip, dict(max_grad_norm=1.0), adaclip.PerLayerClipping(max_grad_norm=1.0)),
    "scaled_clip": (aj.scaled_clip, dict(max_grad_norm=1.0, layer_scales=(1.0, 2.0)),
                    adaclip.ScaledClipping(1.0, (1.0, 2.0))),  # fmt: skip
    "quantile_clip": (aj.quantile_clip, dict(max_grad_norm=0.5, quantile=adaclip.QuantileRule(count_noise_multiplier=1.0)),
                      adaclip.QuantileClipping(0.5, adaclip.QuantileRule(count_noise_multiplier=1.0))),  # fmt: skip
    "scale_then_privatize": (aj.scale_then_privatize, dict(max_grad_norm=0.5),
                             adaclip.AdaptiveClipping.scale_then_privatize(0.5)),  # fmt: skip
}


def _params_and_grads():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    grads = {"w": jnp.arange(24.0).reshape(4, 3, 2) / 10, "b": jnp.arange(8.0).reshape(4, 2) / 10}
    return params, grads


def _two_releases(tx):
    params, grads = _params_and_grads()
    state = tx.init(params)
    out = []
    for _ in range(2):
        update, state = tx.update(grads, state, params)
        out.append(update)
    return out


def test_release_options_name_the_keywords_private_aggregate_takes():
    assert RELEASE_OPTION_NAMES == tuple(ReleaseOptions.__annotations__)
    assert RELEASE_OPTION_NAMES[:2] == ("noise_multiplier", "expected_batch_size")
    import inspect

    aggregate = inspect.signature(aj.private_aggregate).parameters
    assert set(RELEASE_OPTION_NAMES) <= set(aggregate)
    assert set(aggregate) - set(RELEASE_OPTION_NAMES) == {"strategy", "use_kernel"}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_alias_releases_what_private_aggregate_releases_with_its_strategy(name):
    alias, own, strategy = ALIASES[name]
    got = _two_releases(alias(**own, **RELEASE))
    want = _two_releases(aj.private_aggregate(strategy, **RELEASE))
    for g, w in zip(got, want, strict=True):
        for k in ("w", "b"):
            assert jnp.array_equal(g[k], w[k]), (name, k)


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_alias_refuses_a_missing_or_unknown_keyword_with_its_own_name(name):
    alias, own, _ = ALIASES[name]
    with pytest.raises(TypeError, match=rf"^{name}\(\) missing 1 required keyword-only argument: 'expected_batch_size'$"):
        alias(**own, noise_multiplier=1.0)
    with pytest.raises(TypeError, match=rf"^{name}\(\) missing 2 required keyword-only arguments: "
                                        r"'noise_multiplier' and 'expected_batch_size'$"):  # fmt: skip
        alias(**own)
    if name != "scale_then_privatize":  # its **options also takes AdaCliP's options
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'use_kernel'$"):
            alias(**own, **RELEASE, use_kernel=True)


def test_alias_checks_the_release_keywords_before_the_strategy():
    # a bad clip norm and a missing σ: the missing keyword is reported, as a signature would
    with pytest.raises(TypeError, match="missing"):
        aj.flat_clip(max_grad_norm=-1.0, expected_batch_size=4.0)
