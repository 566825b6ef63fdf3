"""The accounting method is named ``accountant=`` everywhere (Opacus's keyword); ``mechanism=``,
adaclip's old name for it, still works in every public function and warns ``FutureWarning`` at
the caller's line, naming the function and the new keyword."""

from __future__ import annotations

import warnings

import pytest

from adaclip import accounting
from adaclip.errors import InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

DELTA = 1e-5
PRIOR = accounting.MinSeparationGaussian(noise_multiplier=4.0, sensitivity=1.0)


def _calls(tmp_path):
    """(name, call with a keyword ``kw`` = {accountant|mechanism: 'rdp'}, what identifies the method used)."""
    return [
        ("Accountant", lambda kw: accounting.Accountant(**kw).mechanism),
        ("calibrate_noise_multiplier", lambda kw: accounting.calibrate_noise_multiplier(
            target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=20, progress=False, **kw)),
        ("calibrate_block_noise_multiplier", lambda kw: accounting.calibrate_block_noise_multiplier(
            target_epsilon=2.0, delta=DELTA, prefix=[0.0, 1.0, 2.0, 3.0], block=2, **kw)),
        ("MinSeparationGaussian.epsilon", lambda kw: PRIOR.epsilon(DELTA, **kw)),
        ("MinSeparationGaussian.calibrate", lambda kw: accounting.MinSeparationGaussian.calibrate(
            target_epsilon=2.0, delta=DELTA, sensitivity=2.0, **kw).noise_multiplier),
        ("PrivacyLedger", lambda kw: _ledger(tmp_path / f"{sorted(kw)[0]}.ledger", kw)),
    ]  # fmt: skip


def _ledger(path, kw):
    with PrivacyLedger(path, **kw) as led:
        return led.mechanism


def test_accountant_keyword_is_canonical_and_mechanism_warns_at_the_callers_line(tmp_path):
    for name, call in _calls(tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # today's keyword warns nothing
            new = call({"accountant": "rdp"})
        with pytest.warns(FutureWarning, match=rf"{name}\(mechanism=\.\.\.\) is deprecated.*accountant=") as caught:
            old = call({"mechanism": "rdp"})
        assert old == new, name  # the same method, the same answer
        assert [w.filename for w in caught if w.category is FutureWarning] == [__file__], name


def test_rdp_is_what_the_keyword_chose():
    # the answers above differ from the default's (PLD), so the keyword was used, not ignored
    default = accounting.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=20)
    rdp = accounting.calibrate_noise_multiplier(
        target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=20, accountant="rdp"
    )
    assert rdp > default
    assert PRIOR.epsilon(DELTA, accountant="rdp") > PRIOR.epsilon(DELTA)


@pytest.mark.parametrize(
    "call",
    [
        lambda: accounting.Accountant("pld", mechanism="rdp"),
        lambda: accounting.Accountant(accountant="pld", mechanism="rdp"),
        lambda: accounting.calibrate_noise_multiplier(
            target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=20, accountant="pld", mechanism="rdp"
        ),
        lambda: PrivacyLedger("never-created.ledger", accountant="pld", mechanism="rdp"),
    ],
)
def test_the_two_keywords_must_agree(call):
    with pytest.raises(InvalidHyperparameterError, match="different accounting methods"), pytest.warns(FutureWarning):
        call()


def test_the_positional_method_is_not_deprecated():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accounting.Accountant("rdp").mechanism == "rdp"
        assert repr(accounting.Accountant("rdp")).startswith("Accountant(accountant='rdp'")
