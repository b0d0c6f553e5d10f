"""Test set-up: Keras on JAX with 8 emulated CPU devices, before JAX starts."""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import keras
import pytest

import keras_meshlayout as kml

kml.emulate_devices(8)


@pytest.fixture(autouse=True)
def _no_global_distribution():
    """Each test starts and ends without a global Keras distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)
