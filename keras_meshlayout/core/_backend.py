"""The JAX backend: checking Keras runs on it, and emulating CPU devices."""

from __future__ import annotations

import numbers
import os
import re

import keras

from .. import _compat
from ._errors import DevicesAlreadyInitializedError, InvalidOptionError, UnsupportedBackendError
from ._targets import quiet_libtpu

_XLA_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def require_jax_backend() -> None:
    """Raises `UnsupportedBackendError` unless Keras runs on JAX."""
    backend = keras.backend.backend()
    if backend != "jax":
        raise UnsupportedBackendError(
            f"keras_meshlayout needs the JAX backend of Keras, but Keras runs on "
            f"{backend!r}. Received: KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}."
            " The backend is fixed when Keras is first imported. Fix: set "
            "KERAS_BACKEND=jax in the environment, or import keras_meshlayout "
            "before keras (it selects JAX when nothing else was chosen)."
        )


def backends_started() -> bool:
    """Whether JAX has already created its backends (and so its devices)."""
    return _compat.backends_started()


def emulate_devices(count: int = 8) -> None:
    """Makes JAX's CPU platform present `count` devices.

    This lets a laptop or CI machine run the same meshes as a host with `count`
    accelerators. It must run before JAX starts its backends, that is before the
    first JAX operation or device query; importing keras_meshlayout does not
    start them. Calling it again with the same count is harmless. When
    accelerators are present they stay the default devices: the emulated ones
    are `jax.devices("cpu")`.

    Args:
        count: Number of CPU devices to emulate.

    Raises:
        DevicesAlreadyInitializedError: JAX already started with a different
            number of CPU devices.
        UnsupportedBackendError: Keras does not run on JAX.
        InvalidOptionError: `count` is not a positive integer.

    Example:
        >>> import keras_meshlayout as kml
        >>> kml.emulate_devices(8)
        >>> import jax
        >>> len(jax.devices("cpu"))
        8
    """
    require_jax_backend()
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise InvalidOptionError(
            f"emulate_devices needs a positive integer device count. Received: count={count!r}."
        )
    quiet_libtpu()  # before JAX's first TPU probe
    import jax

    if backends_started():
        started = len(jax.devices("cpu"))
        if started == count:
            return
        raise DevicesAlreadyInitializedError(
            f"emulate_devices({count}) was called after JAX had already started "
            f"with {started} CPU device(s). JAX fixes its device count when it "
            "first touches a device (any JAX operation, jax.devices(), or building "
            "a Keras model). Fix: call kml.emulate_devices() at the very top of the "
            "script, before anything else uses JAX, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before Python starts."
        )
    flags = _XLA_DEVICE_COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_num_cpu_devices", int(count))
