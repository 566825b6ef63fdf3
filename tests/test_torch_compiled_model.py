"""A ``torch.compile``'d model (or submodule) is refused up front, with the way out.

Under ``torch.compile`` the per-example hooks do not run as in eager mode: measured with
torch 2.13 on CPU, a compiled MLP's first layer lost its per-example gradients (the step was
refused with a misleading "no grad_sample" error) and AdaCliP's materialised path failed with a
``TypeError`` inside dynamo. Until the hooks run under compilation the wrappers and
``make_private`` refuse such a model before building anything, naming the module and the way
out (the uncompiled model; ``compile_release=True`` compiles the release).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.privacy import make_private
from adaclip_torch.validation import validate


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _state(model):
    return [p.detach().clone() for p in model.parameters()], [len(m._forward_hooks) for m in model.modules()]


@pytest.mark.parametrize("where", ["root", "submodule"])
@pytest.mark.parametrize("wrapper", ["FlatClip", "AdaClip", "make_private"])
def test_a_compiled_model_is_refused_before_anything_is_built(where, wrapper):
    model = _model()
    if where == "root":
        given, name = torch.compile(model), "'<root>'"
    else:
        model[0] = torch.compile(model[0])
        given, name = model, "'0'"
    before = _state(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidHyperparameterError, match=rf"module {name} is OptimizedModule: a torch.compile'd model.*_orig_mod"):
        if wrapper == "FlatClip":
            FlatClip(sgd, given, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0)
        elif wrapper == "AdaClip":
            AdaClip(sgd, given, noise_multiplier=1.0, expected_batch_size=4.0)
        else:
            data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,))), batch_size=4)
            make_private(given, sgd, data, noise_multiplier=1.0)
    after = _state(model)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)) and before[1] == after[1]


def test_validate_names_the_compiled_module_and_the_uncompiled_model_passes():
    model = _model()
    assert any("OptimizedModule" in line for line in validate(torch.compile(model)))
    assert validate(model) == []
