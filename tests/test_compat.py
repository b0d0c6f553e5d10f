"""The one seam to Keras's and JAX's internals (keras_meshlayout/_compat/).

Each internal `_compat` reaches is checked here against the installed Keras and JAX, one
test per internal: when an upgrade removes or changes one, its test fails saying which
internal broke and what `kml` uses it for. A second group of tests reads the package's
source with `ast` and checks that no module but `_compat/` reaches an internal, so the
seam stays the only one.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from pathlib import Path

import jax
import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout import _compat
from keras_meshlayout.planner._unpacking import lora_layers, lora_parts

PACKAGE = Path(kml.__file__).parent
SEAM = PACKAGE / "_compat"  # its modules' docstrings name every internal they reach

FEATURES = 4


def _model() -> keras.Model:
    inputs = keras.Input((FEATURES,), name="x")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="head")(keras.layers.Dropout(0.0, name="drop")(hidden))
    model = keras.Model(inputs, outputs, name="tiny")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(rows: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((rows, FEATURES), "float32"), np.zeros((rows, 2), "float32")


def _during_predict(model: keras.Model, probe: Callable[[keras.Model], object]) -> object:
    """What `probe(model)` returns while Keras's predict loop runs (from a batch callback)."""
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            seen.append(probe(model))

    model.predict(_data()[0], verbose=0, callbacks=[Probe()])
    return seen[0]


# -- one check per internal: each returns nothing and asserts what kml relies on -----------


def _trainer_class():
    trainer = _compat.trainer_class()
    assert issubclass(keras.Model, trainer), f"keras.Model does not inherit {trainer}"
    for name in _compat.TRAINER_METHODS:
        assert getattr(keras.Model, name) is getattr(trainer, name), (
            f"keras.Model.{name} is not the trainer's"
        )


def _trainer_methods_wrapped():
    kml.ModelParallel(kml.Mesh(data=8))  # installs the wrappers
    for name in _compat.TRAINER_METHODS:
        assert getattr(getattr(keras.Model, name), "_kml_guarded", False), (
            f"keras.Model.{name} is not wrapped"
        )


def _purge_model_variables():
    kml.ModelParallel(kml.Mesh(data=8))
    assert getattr(_compat.trainer_class()._purge_model_variables, "_kml_guarded", False)
    purged = _during_predict(_model(), lambda m: [_compat.raw_value(v) is None for v in m.weights])
    assert purged and all(purged), f"the weights' values were not emptied during predict: {purged}"


def _variable_value():
    variable = keras.Variable(np.arange(3.0, dtype="float32"))
    assert np.array_equal(np.asarray(_compat.raw_value(variable)), [0.0, 1.0, 2.0])
    _compat.set_raw_value(variable, jax.numpy.asarray([5.0, 6.0, 7.0]))
    assert np.array_equal(variable.numpy(), [5.0, 6.0, 7.0]), "setting Variable._value did not set the value"


def _jax_state():
    model = _model()
    pending = _during_predict(model, _compat.pending_state)
    assert pending is not None, "no pending state during predict"
    assert set(_compat.STATE_KEYS) & set(pending), f"keys {sorted(pending)}"
    assert len(pending["trainable_variables"]) == len(model.trainable_variables)
    assert _compat.pending_state(model) is None and _compat.state_object(model) is None, "not cleared after"
    model._jax_state, model._jax_state_synced = {"trainable_variables": []}, False  # as a loop leaves it
    _compat.clear_pending_state(model)
    assert _compat.pending_state(model) is None


def _variable_groups():
    model = _model()
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append({key: len(value) for key, value in _compat.pending_state(model).items()})

    model.fit(*_data(), epochs=1, verbose=0, callbacks=[Probe()])
    groups = {key: len(value) for key, value in _compat.variable_groups(model).items()}
    assert tuple(groups) == _compat.STATE_KEYS
    assert seen[0] == groups, f"the trainer's state {seen[0]} is not kml's groups {groups}"


def _initial_epoch():
    model = _model()
    _compat.set_initial_epoch(model, 2)
    history = model.fit(*_data(), epochs=3, verbose=0)
    assert history.epoch == [2], f"fit ran epochs {history.epoch}, not just the third"


def _name_scope_stack():
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(_compat.name_scope_callers())
            return x

    layer = Probe(name="probe")
    layer(np.zeros((1, 2), "float32"))
    assert seen and seen[0] and seen[0][0] is layer, f"callers seen in call: {seen}"


def _global_attributes():
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("kml_probe", [1])
    with _compat.global_attribute_kept("kml_probe", list):
        global_state.set_global_attribute("kml_probe", [2])
    assert global_state.get_global_attribute("kml_probe") == [1]
    global_state.set_global_attribute("kml_probe", None)


def _stateless_scope():
    layer = keras.layers.Dense(1024)
    assert not _compat.in_stateless_scope()
    with _compat.stateless_scope():
        assert _compat.in_stateless_scope()
        layer.build((None, 1024))
    assert _compat.raw_value(layer.kernel) is None, "a variable built in a StatelessScope was allocated"
    assert tuple(layer.kernel.shape) == (1024, 1024)


def _traced_quantize():
    """In a dry build `quantize` makes Keras's quantized variables, allocating and assigning nothing."""
    from keras.src import quantizers

    own = quantizers.abs_max_quantize
    with _compat.stateless_scope() as scope:  # Keras wraps each layer's `quantize` as it is made: made here
        layers = {
            "int8": keras.layers.EinsumDense("btd,ndh->btnh", (None, 4, 16), name="query"),
            "int4": keras.layers.EinsumDense("btd,ndh->btnh", (None, 4, 16), name="query"),
            "embedding": keras.layers.Embedding(512, 64, name="table"),
        }
        layers["int8"].build((None, 8, 64))
        layers["int4"].build((None, 8, 64))
        layers["embedding"].build((None, 8))
        layers["int8"].quantize("int8")
        layers["int4"].quantize("int4")
        layers["embedding"].quantize("int4")
        assert quantizers.abs_max_quantize is not own
        assert not scope.state_mapping, "a traced value was left assigned"
    assert quantizers.abs_max_quantize is own, "the patch outlived the scope"
    shapes = {name: {v.path: (tuple(v.shape), v.dtype) for v in one.weights} for name, one in layers.items()}
    assert shapes["int8"]["query/kernel"] == ((4, 64, 16), "int8")
    assert shapes["int8"]["query/kernel_scale"] == ((1, 1, 4, 16), "float32")
    assert shapes["int4"]["query/kernel"] == ((64, 32), "int8")  # (hidden, heads × head_dim ÷ 2), packed
    assert shapes["embedding"]["table/embeddings"] == ((512, 32), "int8")
    assert all(_compat.raw_value(v) is None for layer in layers.values() for v in layer.weights)


def _value_made_variable():
    from keras.src.backend.common import variables

    init = variables.Variable.__init__
    with _compat.stateless_scope():
        counter = keras.Variable(3, dtype="int32", name="counter")  # Keras alone refuses a value here
    assert variables.Variable.__init__ is init, "the patch outlived the scope"
    assert _compat.raw_value(counter) is None and tuple(counter.shape) == () and counter.dtype == "int32"


def _global_seed_generator():
    created = _compat.global_seed_generator(create=True)
    assert isinstance(created, keras.random.SeedGenerator), type(created)
    assert _compat.global_seed_generator() is created


def _distribute_tensor():
    from keras.src.distribution import distribution_lib

    assert list(inspect.signature(distribution_lib.distribute_tensor).parameters) == ["tensor", "layout"]
    kml.ModelParallel(kml.Mesh(data=8))
    assert getattr(distribution_lib.distribute_tensor, "_kml_guarded", False)
    # Keras looks it up on the module at each layer call: our check runs (a rank-3 rule, a rank-2 output).
    with kml.ModelParallel(kml.Mesh(data=2, model=4), [(".*dense/output", ("data", None, None))]).scope():
        with pytest.raises(kml.RankMismatchError):
            keras.layers.Dense(4, name="dense")(keras.Input((8,)))


def _compile_metrics():
    from keras_meshlayout import _compat

    metric = keras.metrics.MeanSquaredError(name="early")
    model = _model()
    model.compile(optimizer="sgd", loss="mse", metrics=[metric], weighted_metrics=[["mae"]])
    assert [v.path for v in _compat.compile_metric_variables(model)] == ["early/total", "early/count"]


def _make_function():
    from keras.src.backend.jax.trainer import JAXTrainer

    original = inspect.unwrap(JAXTrainer._make_function)
    assert list(inspect.signature(original).parameters)[:2] == ["self", "step_function"]
    kml.ModelParallel(kml.Mesh(data=8))
    assert getattr(JAXTrainer._make_function, "_kml_guarded", False)
    # The state of a group's steps is recorded: an error after the first keeps what they trained.
    with kml.ModelParallel(kml.Mesh(data=8)).scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        with pytest.raises(kml.IndivisibleBatchError):
            model.fit(*_data(44), batch_size=8, epochs=1, verbose=0, shuffle=False)
        assert int(model.optimizer.iterations) == 5


def _distribute_data_input():
    from keras.src.backend.jax import distribution_lib

    parameters = list(inspect.signature(distribution_lib.distribute_data_input).parameters)
    assert parameters == ["per_process_batch", "layout", "batch_dim_name"], parameters
    kml.ModelParallel(kml.Mesh(data=8))
    assert getattr(distribution_lib.distribute_data_input, "_kml_guarded", False)
    # Keras looks it up on the module for every batch: our check runs (a batch of 3 on data=2).
    model = _model()
    with kml.ModelParallel(kml.Mesh(data=2, model=4)).scope():
        model = _model()
        with pytest.raises(kml.IndivisibleBatchError):
            model.fit(*_data(3), batch_size=3, epochs=1, verbose=0)


def _initialize_rng():
    from keras.src.backend.jax import distribution_lib

    assert distribution_lib.initialize_rng is not None
    assert list(inspect.signature(distribution_lib.initialize_rng).parameters) == []
    assert callable(_compat.initialize_rng)


def _variable_layout():
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["tiny/hidden/kernel"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data").scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(8, name="hidden")], name="tiny"
        )
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    slot = next(v for v in optimizer.variables if tuple(v.shape) == (FEATURES, 8))
    layout = _compat.variable_layout(slot)
    assert tuple(layout.axes) == (None, "model"), f"the slot's layout is {layout}"


def _tensor_layout_mesh():
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), jax.devices())
    layout = _compat.tensor_layout((("data", "model"), None), mesh)
    assert layout.device_mesh is mesh, f"the layout's mesh is {layout.device_mesh}"
    assert layout.backend_layout.spec == jax.sharding.PartitionSpec(("data", "model"), None)


def _layout_map_mesh():
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), jax.devices())
    assert _compat.layout_map_mesh(keras.distribution.LayoutMap(mesh)) is mesh
    assert _compat.layout_map_mesh(keras.distribution.LayoutMap(None)) is None


def _callback_model():
    callback, model = keras.callbacks.Callback(), keras.Sequential([keras.layers.Dense(1)])
    assert _compat.callback_model(callback) is None
    callback.set_model(model)
    assert _compat.callback_model(callback) is model


def _model_parallel_layout_map():
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), jax.devices())
    first, second = keras.distribution.LayoutMap(mesh), keras.distribution.LayoutMap(mesh)
    second["dense/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=first, batch_dim_name="data")
    assert _compat.distribution_layout_map(distribution) is first
    _compat.set_distribution_layout_map(distribution, second)
    assert distribution.get_tensor_layout("dense/kernel").axes == (None, "model")  # Keras reads the new map


def _overwrite_with_gradient():
    optimizer = keras.optimizers.SGD()
    plain = keras.Variable(np.zeros(2, "float32"))
    overwritten = keras.Variable(np.zeros(2, "float32"))
    overwritten.overwrite_with_gradient = True
    assert not _compat.keeps_no_slots(optimizer, plain)
    assert _compat.keeps_no_slots(optimizer, overwritten)


def _muon_adamw():
    optimizer = keras.optimizers.Muon(exclude_layers=["head"])
    kernel, bias = keras.Variable(np.zeros((4, 8), "float32")), keras.Variable(np.zeros(8, "float32"))
    table = keras.Variable(np.zeros((16, 4), "float32"), name="embeddings")
    assert _compat.orthogonalised(optimizer, kernel)
    assert not any(_compat.orthogonalised(optimizer, v) for v in (bias, table))


def _flatten_layers():
    inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="inner_dense")], name="inner")
    outer = keras.Sequential([keras.Input((2,)), inner, keras.layers.Dense(2, name="outer_dense")], name="o")
    names = [
        layer.name for layer in _compat.sublayers(outer) if not isinstance(layer, keras.layers.InputLayer)
    ]
    assert names == ["inner", "inner_dense", "outer_dense"], names
    names = [layer.name for layer in _compat.sublayers(outer, recursive=False)]
    assert names[1:] == ["inner", "outer_dense"] and outer not in _compat.sublayers(outer), names


def _build_shapes():
    layer = keras.layers.Dense(3)
    layer.build((None, 5))
    assert _compat.build_shapes(layer) == {"input_shape": (None, 5)}, _compat.build_shapes(layer)
    assert _compat.build_shapes(keras.layers.Dense(3)) == {}


def _inputs_struct():
    left, right = keras.Input((2,), name="left"), keras.Input((2,), name="right")
    model = keras.Model({"left": left, "right": right}, keras.layers.Add()([left, right]))
    structure = _compat.input_structure(model)
    assert isinstance(structure, dict) and sorted(structure) == ["left", "right"], structure


def _call_has_training_arg():
    assert _compat.takes_training(keras.layers.Dropout(0.5))

    class NoTraining(keras.layers.Layer):
        def call(self, x):
            return x

    assert not _compat.takes_training(NoTraining())


def _keras_history():
    model = _model()
    assert _compat.made_by_a_layer(model.outputs[0])
    assert not _compat.made_by_a_layer(keras.KerasTensor((2,)))
    assert _compat.producing_layer(model.outputs[0]) is model.get_layer("head")


def _inbound_nodes():
    model = _model()
    assert _compat.input_layers(model.get_layer("head")) == [model.get_layer("drop")]
    assert _compat.input_layers(model.get_layer("hidden")) == [model.layers[0]]  # the InputLayer


def _remat_mode():
    with keras.RematScope(mode="full"):
        inside = keras.layers.Dense(2)
    model = keras.Sequential([keras.Input((3,)), inside])
    assert _compat.rematerialised(model) and not _compat.rematerialised(_model())


def _compute_output_spec():
    """A sub-layer left to the first call is built on symbolic inputs, as `fit` builds it."""

    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    model = Lazy()
    assert _compat.unbuilt_layers(model) and not model.weights
    _compat.build_layers(model, np.zeros((2, 3), "float32"))
    assert not _compat.unbuilt_layers(model) and [tuple(w.shape) for w in model.weights] == [(3, 4), (4,)]


def _lora_enabled():
    """`enable_lora` adds `lora_kernel_a`/`_b`; `kernel` is the base kernel again with `lora_enabled` off."""
    for layer, x in (
        (keras.layers.Dense(6), np.ones((2, 4), "float32")),
        (keras.layers.EinsumDense("bd,dnh->bnh", (3, 2)), np.ones((2, 4), "float32")),
    ):
        layer.build(x.shape)
        layer.enable_lora(2)
        layer.lora_kernel_b.assign(np.ones(layer.lora_kernel_b.shape, "float32"))
        base, a, b = lora_parts(layer)
        assert a is layer.lora_kernel_a and b is layer.lora_kernel_b and base.path.endswith("/kernel")
        assert layer.lora_enabled and layer.kernel is not base
        model = keras.Sequential([keras.Input(x.shape[1:]), layer])
        with _compat.lora_off(model):
            assert layer.kernel is base and not layer.lora_enabled
        assert layer.lora_enabled and lora_layers(model) == [layer]


def _own_variables():
    inner = keras.layers.Dense(2, name="inner_dense")
    norm = keras.layers.BatchNormalization()
    norm.build((None, 2))
    inner.build((None, 2))
    assert [v.path for v in _compat.own_variables(inner)] == [v.path for v in inner.weights]
    assert len(_compat.own_variables(norm)) == 4  # gamma, beta, then the moving mean and variance
    model = keras.Sequential([keras.Input((2,)), inner])
    assert _compat.own_variables(model) == []


def _symbolic_build():
    model = _model()
    _compat.symbolic_build(model, _data())
    assert model.optimizer.built, "the optimizer was not built"


def _state_sharding_spec():
    model = _model()
    _compat.symbolic_build(model, _data())
    spec = _compat.state_shardings(model)
    assert len(spec) == len(_compat.STATE_KEYS), spec
    assert len(spec[0]) == len(model.trainable_variables)


def _backends_are_initialized():
    jax.devices()
    assert _compat.backends_started() is True


def _register_atexit():
    import inspect
    import threading

    assert list(inspect.signature(threading._register_atexit).parameters) == ["func", "arg", "kwargs"]


def _tpu_chips_attached():
    chips = _compat.tpu_chips_attached()
    tpus = [device for device in jax.devices() if device.platform == "tpu"]
    assert chips == len(tpus), (chips, tpus)  # none on a machine without TPUs


def _dce_jaxpr():
    closed = jax.make_jaxpr(lambda x, y: x * 2.0)(1.0, 2.0)
    jaxpr, used = _compat.dce_jaxpr(closed.jaxpr)
    assert used == [True, False], used
    assert len(jaxpr.eqns) == 1


def _stored_int4_weights():
    """An int4 layer's stored variable is the packed one its `kernel` property unpacks; replaced, the
    property reads the stored one, and Keras's comes back after the block."""
    dense, table = keras.layers.Dense(6), keras.layers.Embedding(8, 6)
    dense.build((None, 4))
    table.build((None,))
    for layer, name in ((dense, "kernel"), (table, "embeddings")):
        layer.quantize("int4")
        stored, rows = _compat.stored_weight(layer, name), 8 if name == "embeddings" else 4
        assert stored.dtype == "int8" and tuple(stored.shape) == (rows, 3)  # two columns a byte
        assert tuple(getattr(layer, name).shape) == (rows, 6)  # unpacked
        read = functools.partial(lambda one, own, n: _compat.stored_weight(one, n), n=name)
        with _compat.property_replaced(type(layer), name, read):
            assert getattr(layer, name) is stored
        assert tuple(getattr(layer, name).shape) != tuple(stored.shape)


#: (internal, what kml uses it for, check). One row per internal named in _compat's docstring.
INTERNALS: list[tuple[str, str, Callable[[], None]]] = [
    (
        "keras.src.backend.jax.trainer.JAXTrainer",
        "the class Model.fit/evaluate/predict come from",
        _trainer_class,
    ),
    ("JAXTrainer.fit/evaluate/predict/*_on_batch", "kml wraps them", _trainer_methods_wrapped),
    ("JAXTrainer._purge_model_variables", "empties the variables during a loop", _purge_model_variables),
    ("Variable._value", "the array a variable holds", _variable_value),
    ("JAXTrainer._jax_state/_jax_state_synced", "the pending state of a loop", _jax_state),
    ("Model.*_variables and Optimizer.variables", "the groups of _jax_state", _variable_groups),
    ("Model._initial_epoch", "the epoch a resumed fit starts from", _initial_epoch),
    ("keras.src.backend.common.global_state name_scope_stack", "the caller of a scope", _name_scope_stack),
    ("keras.src.backend.common.global_state", "a dry build's global state", _global_attributes),
    (
        "keras.src.backend.common.stateless_scope.StatelessScope",
        "builds without allocating",
        _stateless_scope,
    ),
    (
        "keras.src.quantizers abs_max_quantize*/pack_int4, StatelessScope.state_mapping",
        "quantize traced in a dry build",
        _traced_quantize,
    ),
    (
        "keras.src.backend.common.variables.Variable.__init__",
        "a variable made from a value, deferred in a dry build",
        _value_made_variable,
    ),
    (
        "keras.src.random.seed_generator.global_seed_generator",
        "the process-wide seed",
        _global_seed_generator,
    ),
    (
        "keras.src.backend.jax.distribution_lib.distribute_data_input",
        "every batch is checked",
        _distribute_data_input,
    ),
    ("keras.src.backend.jax.distribution_lib.initialize_rng", "the first collective", _initialize_rng),
    (
        "keras.src.distribution.distribution_lib.distribute_tensor",
        "every layer output under an output rule is checked",
        _distribute_tensor,
    ),
    ("JAXTrainer._make_function", "the state each compiled step returns", _make_function),
    (
        "Model._compile_metrics._user_metrics/_user_weighted_metrics",
        "the metric objects given to compile",
        _compile_metrics,
    ),
    ("Variable._layout", "an optimizer slot's layout", _variable_layout),
    ("Optimizer._overwrite_variable_with_gradient", "parameters without slots", _overwrite_with_gradient),
    ("Muon._should_use_adamw", "the matrices Muon orthogonalises", _muon_adamw),
    ("TensorLayout._device_mesh", "a layout with a multi-axis entry", _tensor_layout_mesh),
    ("LayoutMap._device_mesh", "the mesh a layout map was made with", _layout_map_mesh),
    ("ModelParallel._layout_map", "the layout map a distribution reads", _model_parallel_layout_map),
    ("Callback._model", "a callback's model, without a state sync", _callback_model),
    ("Layer._flatten_layers", "every sub-layer", _flatten_layers),
    ("Layer._build_shapes_dict", "the shapes a layer was built with", _build_shapes),
    ("Model._inputs_struct", "a functional model's input structure", _inputs_struct),
    ("Layer._call_has_training_arg", "whether call takes training", _call_has_training_arg),
    ("KerasTensor._keras_history", "the layer that made a tensor", _keras_history),
    ("Layer._inbound_nodes", "the layers a layer is called on", _inbound_nodes),
    ("Layer._remat_mode", "the RematScope a layer was made in", _remat_mode),
    ("backend.compute_output_spec", "a lazy model's layers built as fit builds them", _compute_output_spec),
    ("Layer._trainable_variables/_non_trainable_variables", "a layer's own variables", _own_variables),
    ("Layer.lora_enabled", "a LoRA layer traced as its base kernel", _lora_enabled),
    ("Dense._kernel/Embedding._embeddings", "an int4 layer's packed weight", _stored_int4_weights),
    ("Model._symbolic_build", "builds the optimizer as fit would", _symbolic_build),
    ("Model._get_state_sharding_spec", "the shardings of the model's state", _state_sharding_spec),
    (
        "jax._src.xla_bridge.backends_are_initialized",
        "whether devices exist already",
        _backends_are_initialized,
    ),
    ("jax._src.interpreters.partial_eval.dce_jaxpr", "dead-code elimination of a jaxpr", _dce_jaxpr),
    (
        "jax._src.hardware_utils.num_available_tpu_chips_and_device_id",
        "whether TPU chips are attached",
        _tpu_chips_attached,
    ),
    ("threading._register_atexit", "a background save finished at exit", _register_atexit),
]


def check_internal(internal: str, use: str, check: Callable[[], None]) -> None:
    """Runs one check; any failure is reported as this internal having changed."""
    try:
        check()
    except Exception as err:  # any failure means the internal changed
        pytest.fail(
            f"{internal} is gone or changed ({use}): {type(err).__name__}: {err}. Keras "
            f"{keras.__version__} / JAX {jax.__version__} changed it; see keras_meshlayout/_compat/."
        )


@pytest.mark.parametrize("internal, use, check", INTERNALS, ids=[row[0] for row in INTERNALS])
def test_internal_is_there(internal, use, check):
    check_internal(internal, use, check)


def _break_flatten_layers(monkeypatch):
    monkeypatch.delattr(keras.layers.Layer, "_flatten_layers")


def _break_dce_jaxpr(monkeypatch):
    from jax._src.interpreters import partial_eval

    monkeypatch.delattr(partial_eval, "dce_jaxpr")


def _break_overwrite_with_gradient(monkeypatch):
    monkeypatch.setattr(
        keras.optimizers.Optimizer, "_overwrite_variable_with_gradient", lambda self, v: False
    )


@pytest.mark.parametrize(
    "internal, breaks",
    [
        ("Layer._flatten_layers", _break_flatten_layers),
        ("jax._src.interpreters.partial_eval.dce_jaxpr", _break_dce_jaxpr),
        ("Optimizer._overwrite_variable_with_gradient", _break_overwrite_with_gradient),
    ],
    ids=["removed-method", "removed-function", "changed-meaning"],
)
def test_a_changed_internal_fails_naming_it(internal, breaks, monkeypatch):
    """What an upgrade that removes or changes an internal looks like: its check names it."""
    _, use, check = next(row for row in INTERNALS if row[0] == internal)
    breaks(monkeypatch)
    with pytest.raises(pytest.fail.Exception) as failed:
        check_internal(internal, use, check)
    message = str(failed.value)
    assert message.startswith(f"{internal} is gone or changed ({use}): "), message
    assert message.endswith(
        f"Keras {keras.__version__} / JAX {jax.__version__} changed it; see keras_meshlayout/_compat/."
    )


def test_every_internal_of_the_docstring_has_a_test():
    """Each internal the seam's docstring lists (a backticked private name) has a row above."""
    named = " ".join(row[0] for row in INTERNALS)
    listed = {
        word.split(".")[-1].split("(")[0]
        for path in sorted(SEAM.glob("*.py"))
        for word in ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))).split("`")[1::2]
    }
    private = {word for word in listed if word.startswith("_") and not word.startswith("__")}
    missing = sorted(word for word in private if word not in named)
    assert private and missing == [], f"internals in _compat's docstring with no check: {missing}"


# -- the seam is the only one ----------------------------------------------------------------

#: Private names of the standard library the package may use (they are documented there).
STDLIB_PRIVATE = {("os", "_exit")}


def _foreign_objects() -> list[object]:
    """Keras and JAX objects whose private names are foreign even where we define the same name."""
    model = _model()
    return [
        model,
        model.layers[1],
        model.weights[0],
        model.optimizer,
        model.outputs[0],
        keras.distribution.DeviceMesh((8,), ("data",), jax.devices()),
        keras.distribution.LayoutMap(keras.distribution.DeviceMesh((8,), ("data",), jax.devices())),
        jax.numpy.zeros(2),
    ]


#: Call sites not yet moved behind the seam, each with the `_compat` function to use instead.
#: Kept exact: a site that is fixed must leave this table (the test fails while it stays).
NOT_YET_MOVED: dict[tuple[str, str], str] = {}


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if SEAM not in path.parents)


@functools.cache  # parsed once per run, not once per module checked (96 times: 26 s of the fast loop, loaded)
def _own_private_names() -> frozenset[str]:
    """Private names the package itself defines: attributes it sets, functions, classes, modules."""
    names = {path.stem for path in PACKAGE.rglob("_*.py")}
    for path in _modules():  # what the seam sets on Keras's objects is not ours
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    names -= {name for obj in _foreign_objects() for name in dir(obj) if name.startswith("_")}
    return frozenset(name for name in names if name.startswith("_"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_private_uses(source: str, own: frozenset[str] | set[str]) -> list[tuple[int, str, str]]:
    """(line, code, private name) for each read or write of another project's private attribute."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if (base, node.attr) in STDLIB_PRIVATE or node.attr in own:
                continue
            uses.append((node.lineno, ast.unparse(node), node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            uses.append((node.lineno, ast.unparse(node), node.args[1].value))
    return uses


def patched_foreign_attributes(source: str) -> list[tuple[int, str]]:
    """(line, code) for each assignment to an attribute of `keras`/`jax` (a runtime patch)."""
    patches = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else []:
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if (
                isinstance(target, ast.Attribute)
                and isinstance(root, ast.Name)
                and root.id in ("keras", "jax")
            ):
                patches.append((node.lineno, ast.unparse(target)))
    return patches


@pytest.mark.parametrize(
    "source, found",
    [
        ("variable._value = 1", ["_value"]),
        ("x = model._jax_state", ["_jax_state"]),
        ("getattr(model, '_jax_state', None)", ["_jax_state"]),
        ("self._value = 1\nself._rules.bind(x)", ["_value"]),  # self. is no exemption
        ("plan._entries", []),  # our own name (set below)
        ("os._exit(1)", []),
        ("type(x).__name__; getattr(f, '__name__', '')", []),
    ],
    ids=["write", "read", "getattr-string", "self", "own-name", "stdlib", "dunder"],
)
def test_foreign_private_uses_finds_them(source, found):
    assert [name for _, _, name in foreign_private_uses(source, {"_entries", "_rules"})] == found


def test_patches_are_found():
    assert patched_foreign_attributes("keras.Model.fit = f\nkeras.x += 1\nmodel.fit = f") == [
        (1, "keras.Model.fit"),
        (2, "keras.x"),
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_only_the_seam_touches_internals(path):
    source = path.read_text(encoding="utf-8")
    relative = str(path.relative_to(PACKAGE))
    problems = [f"{marker!r} appears" for marker in ("keras.src", "jax._src") if marker in source]
    for line, code, name in foreign_private_uses(source, _own_private_names()):
        if (relative, name) not in NOT_YET_MOVED:
            problems.append(f"line {line}: {code} reads or writes a private attribute of Keras or JAX")
    problems += [
        f"line {line}: {code} = ... patches Keras or JAX" for line, code in patched_foreign_attributes(source)
    ]
    assert problems == [], (
        f"keras_meshlayout/{relative} reaches Keras/JAX internals outside the seam: {problems}. "
        "Fix: add a small function to keras_meshlayout/_compat/ (named in its docstring, with a "
        "check in tests/test_compat.py) and call it."
    )


def test_not_yet_moved_sites_are_still_there():
    """The exception table above stays exact: a fixed call site must leave it."""
    own = _own_private_names()
    stale = [
        (relative, name, fix)
        for (relative, name), fix in NOT_YET_MOVED.items()
        if name not in {use[2] for use in foreign_private_uses((PACKAGE / relative).read_text(), own)}
    ]
    assert stale == [], f"these call sites now use _compat; remove them from NOT_YET_MOVED: {stale}"
