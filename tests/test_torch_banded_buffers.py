"""Banded noise's buffers as one matrix (``adaclip_torch.correlated.NoiseStream``).

The ``b − 1`` buffers are the rows of one ``(b − 1, D)`` matrix and the correlation
``x_t = (z_t − Σ_j c_j x_{t−j})/c_0`` is one matrix-vector product that reads each buffer once.
Checked here on the stream itself, against the core's recursion
(:meth:`adaclip.correlated.BandedNoise.correlate`) on the same draws: several tensors, the
warm-up and the wrap-around of the rows, a discarded step, a checkpoint restored mid-stream
(bit for bit), and that the work is one product (the per-band loop made ``b − 1`` passes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaclip.correlated import BandedNoise
from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients
from adaclip_torch.correlated import MATRIX_MIN_BANDS, NoiseStream
from adaclip_torch.data import CyclicPoissonBatchSampler

SHAPES = [(4, 3), (5,), ()]


def _stream(bands):
    mechanism = BandedNoise(sqrt_toeplitz_coefficients(bands))
    sampler = CyclicPoissonBatchSampler(640, 1 / 64, bands)
    return NoiseStream(mechanism, sample_rate=1 / 64, sampler=sampler), mechanism


def _draws(seed, steps, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("bands", [MATRIX_MIN_BANDS, MATRIX_MIN_BANDS + 5])
def test_the_stream_is_the_core_recursion_on_the_same_draws(bands):
    stream, mechanism = _stream(bands)
    state = mechanism.init()
    for z in _draws(0, 3 * bands):  # warm-up, then the rows wrap around twice
        x = stream.correlate(z)
        stream.commit()
        want, state = mechanism.correlate(state, [t.numpy() for t in z])
        for a, b in zip(x, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-12, atol=1e-14)
            assert tuple(a.shape) == tuple(b.shape)


def test_a_discarded_step_leaves_the_buffers_as_they_were():
    stream, _ = _stream(MATRIX_MIN_BANDS + 1)
    reference, _ = _stream(MATRIX_MIN_BANDS + 1)
    draws = _draws(1, 40)
    for t, z in enumerate(draws):
        if t in (3, 7, 30):  # a step that is not released: its noise is forgotten
            stream.correlate([torch.randn_like(u) for u in z])
            stream.discard()
        got, want = stream.correlate(z), reference.correlate(z)
        stream.commit()
        reference.commit()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_stream_restored_mid_way_continues_bit_for_bit():
    bands = MATRIX_MIN_BANDS + 2
    stream, _ = _stream(bands)
    draws = _draws(2, 2 * bands + 10)
    for z in draws[: bands + 7]:  # past a wrap-around of the rows
        stream.correlate(z)
        stream.commit()
    saved = stream.state_dict(with_buffers=True)
    restored, _ = _stream(bands)
    restored.load_state_dict(saved, steps=bands + 7, shapes=SHAPES)
    for z in draws[bands + 7 :]:
        a, b = stream.correlate(z), restored.correlate(z)
        stream.commit()
        restored.commit()
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    # the saved buffers are copies, not views of the live matrix (which later steps overwrite)
    live = stream._ring.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != live for x in saved["buffers"] for t in x)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops_of_a_step(bands):
    stream, _ = _stream(bands)
    for z in _draws(3, bands + 4, dtype=torch.float32):
        with _Ops() as ops:
            stream.correlate(z)
        stream.commit()
    return ops.names


def test_the_correlation_is_one_matrix_vector_product():
    """From :data:`MATRIX_MIN_BANDS` bands the step's correlation is one ``addmv`` and no
    per-band additions (the loop it replaces made ``b − 1`` fused multiply-adds over every
    tensor); below, the loop (as fast there, with less bookkeeping)."""
    names = _ops_of_a_step(32)
    assert names.count("addmv") == 1, names
    assert not any(name.startswith("_foreach_add") for name in names), names
    names = _ops_of_a_step(4)
    assert "addmv" not in names and names.count("_foreach_add_") == 3, names
