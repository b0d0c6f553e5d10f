"""Pictures: the mesh and a variable's blocks in the terminal, and the plan as a PNG.

Blocks are checked against the index map of a real `NamedSharding`, the PNG by
its pixel size and content.
"""

from __future__ import annotations

import io
import re
import sys

import jax
import keras
import numpy as np
import pytest
from helpers import build_encoder
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console

import keras_meshlayout as kml


def render(picture, width: int = 160) -> list[str]:
    """What a terminal without colour shows, line by line."""
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(picture)
    return [line.rstrip() for line in console.export_text().splitlines()]


def cells(line: str) -> list[str]:
    """The cells of one table row, stripped (the text outside the outer borders dropped)."""
    return [cell.strip() for cell in re.split("[│┃]", line)[1:-1]]


# -- the mesh ----------------------------------------------------------------------


def test_show_mesh_1d():
    lines = render(kml.show_mesh(kml.Mesh(data=8)))
    assert lines[0] == "Mesh data=8: 8 cpu devices (device ids)"
    assert cells(lines[2]) == [f"data {i}" for i in range(8)]
    assert cells(lines[4]) == [str(i) for i in range(8)]


def test_show_mesh_2d():
    mesh = kml.Mesh(data=2, model=4)
    lines = render(kml.show_mesh(mesh))
    assert lines[0] == "Mesh data=2 × model=4: 8 cpu devices (device ids)"
    assert cells(lines[2]) == ["data ╲ model", "model 0", "model 1", "model 2", "model 3"]
    assert cells(lines[4]) == ["data 0", "0", "1", "2", "3"]
    assert cells(lines[5]) == ["data 1", "4", "5", "6", "7"]
    assert str(kml.show_mesh(mesh)).splitlines() == lines


def test_show_mesh_shows_the_devices_where_they_are():
    """A mesh over devices in another order shows each id at its own position."""
    devices = list(reversed(jax.devices()))
    lines = render(kml.show_mesh(kml.Mesh(data=2, model=4, devices=devices)))
    assert cells(lines[4]) == ["data 0", "7", "6", "5", "4"]
    assert cells(lines[5]) == ["data 1", "3", "2", "1", "0"]


def test_show_mesh_of_a_keras_device_mesh():
    """Keras meshes built from `keras.distribution.list_devices()` hold device names, not devices."""
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), keras.distribution.list_devices())
    assert render(kml.show_mesh(mesh)) == render(kml.show_mesh(kml.Mesh(data=2, model=4)))
    assert our_blocks(mesh, (8, 16), ("data", "model")) == our_blocks(
        kml.Mesh(data=2, model=4), (8, 16), ("data", "model")
    )


def test_show_mesh_3d_draws_one_grid_per_index_of_the_first_axis():
    lines = render(kml.show_mesh(kml.Mesh(stage=2, data=2, model=2)), width=100)
    assert lines[0] == "Mesh stage=2 × data=2 × model=2: 8 cpu devices (device ids)"
    # Two panels side by side, titled by the first axis; each a data × model grid.
    assert lines[1].count("stage=0") == 1 and lines[1].count("stage=1") == 1
    assert lines[1].index("stage=0") < lines[1].index("stage=1")
    assert lines[3].count("data ╲ model") == 2
    rows = [[cell for cell in cells(line) if cell] for line in lines[5:7]]
    assert rows == [
        ["data 0", "0", "1", "data 0", "4", "5"],
        ["data 1", "2", "3", "data 1", "6", "7"],
    ]


# -- a variable's blocks -------------------------------------------------------------


def jax_blocks(mesh: kml.Mesh, shape: tuple, axes: tuple) -> dict[int, tuple]:
    """Device id → its block's ranges, from an array really placed with JAX."""
    array = jax.device_put(
        np.zeros(shape, np.float32), NamedSharding(mesh.backend_mesh, PartitionSpec(*axes))
    )
    index_map = array.sharding.devices_indices_map(shape)
    assert {device.id for device in index_map} == {shard.device.id for shard in array.addressable_shards}
    return {
        device.id: tuple(slice_.indices(size)[:2] for slice_, size in zip(index, shape, strict=True))
        for device, index in index_map.items()
    }


def our_blocks(mesh: kml.Mesh, shape: tuple, axes: tuple) -> dict[int, tuple]:
    held = {}
    for block in kml.sharding_blocks(mesh, shape, axes):
        for device in block.devices:
            assert device not in held, f"device {device} holds two blocks"
            held[device] = block.ranges
    return held


LAYOUTS = [
    ((2, 4), (64, 4, 16), (None, "model", None)),  # attention query kernel: heads over model
    ((2, 4), (4, 16, 64), ("model", None, None)),  # attention output kernel
    ((2, 4), (64, 4, 16), ("data", "model", None)),
    ((2, 4), (128, 256), ("data", "model")),
    ((2, 4), (128, 256), ("model", "data")),
    ((2, 4), (128, 256), (None, "model")),
    ((2, 4), (256,), ("model",)),
    ((2, 4), (128, 256), (None, None)),
    ((2, 4), (64, 32), (("data", "model"), None)),
    ((2, 4), (), ()),
    ((8,), (3, 3, 16, 64), (None, None, None, "data")),  # a convolution kernel
    ((2, 2, 2), (8, 8, 8), ("model", "stage", "data")),
]
LAYOUT_IDS = [
    "query-kernel-heads",
    "output-kernel-heads",
    "3d-both-axes",
    "2d-data-model",
    "2d-model-data",
    "2d-columns",
    "1d",
    "replicated",
    "two-axes-one-dim",
    "scalar",
    "conv-1d-mesh",
    "3d-mesh",
]


def mesh_of(sizes: tuple[int, ...]) -> kml.Mesh:
    names = {1: ("data",), 2: ("data", "model"), 3: ("stage", "data", "model")}[len(sizes)]
    return kml.Mesh(dict(zip(names, sizes, strict=True)))


@pytest.mark.parametrize("mesh_shape, shape, axes", LAYOUTS, ids=LAYOUT_IDS)
def test_blocks_match_jax(mesh_shape, shape, axes):
    mesh = mesh_of(mesh_shape)
    assert our_blocks(mesh, shape, axes) == jax_blocks(mesh, shape, axes)


def test_blocks_match_jax_on_devices_in_another_order():
    mesh = kml.Mesh(data=2, model=4, devices=list(reversed(jax.devices())))
    for shape, axes in [((64, 4, 16), (None, "model", None)), ((128, 256), ("data", "model"))]:
        assert our_blocks(mesh, shape, axes) == jax_blocks(mesh, shape, axes)


def test_blocks_of_an_attention_kernel():
    blocks = kml.sharding_blocks(kml.Mesh(data=2, model=4), (64, 8, 16), (None, "model", None))
    assert [(str(block), block.devices, block.shape) for block in blocks] == [
        ("[0:64, 0:2, 0:16]", (0, 4), (64, 2, 16)),
        ("[0:64, 2:4, 0:16]", (1, 5), (64, 2, 16)),
        ("[0:64, 4:6, 0:16]", (2, 6), (64, 2, 16)),
        ("[0:64, 6:8, 0:16]", (3, 7), (64, 2, 16)),
    ]
    array = np.arange(64 * 8 * 16).reshape(64, 8, 16)
    assert array[blocks[1].index].shape == (64, 2, 16)


def test_show_sharding_3d_kernel_from_a_plan():
    mesh = kml.Mesh(data=2, model=4)
    plan = kml.dry_plan(build_encoder, kml.ModelParallel(mesh, kml.transformer_rules()), optimizer="sgd")
    entry = plan["attention/query/kernel"]
    assert (entry.shape, entry.axes) == ((64, 4, 16), (None, "model", None))
    lines = render(kml.show_sharding(mesh, entry))
    assert lines[0] == (
        "attention/query/kernel (64, 4, 16) float32 · layout (None, model, None) · mesh data=2 × model=4"
    )
    assert lines[1] == (
        "4 blocks of shape (64, 1, 16), each on 2 devices: dim 1 split over model (4), "
        "replicated over data (2); 4.0 KiB per device"
    )
    assert cells(lines[3]) == ["block", "index", "shape", "devices"]
    assert [cells(line) for line in lines[5:9]] == [
        ["0", "[0:64, 0:1, 0:16]", "(64, 1, 16)", "0, 4"],
        ["1", "[0:64, 1:2, 0:16]", "(64, 1, 16)", "1, 5"],
        ["2", "[0:64, 2:3, 0:16]", "(64, 1, 16)", "2, 6"],
        ["3", "[0:64, 3:4, 0:16]", "(64, 1, 16)", "3, 7"],
    ]


def test_show_sharding_2d_grid():
    lines = render(kml.show_sharding(kml.Mesh(data=2, model=4), (8, 16), ("data", "model")))
    assert lines[0] == "shape (8, 16) · layout (data, model) · mesh data=2 × model=4"
    assert lines[1] == (
        "8 blocks of shape (4, 4), each on 1 device: dim 0 split over data (2), dim 1 split over model (4)"
    )
    assert cells(lines[3]) == ["", "[:, 0:4]", "[:, 4:8]", "[:, 8:12]", "[:, 12:16]"]
    assert cells(lines[5]) == ["[0:4, :]", "0", "1", "2", "3"]
    assert cells(lines[6]) == ["[4:8, :]", "4", "5", "6", "7"]
    assert lines[8] == "Cells: the ids of the devices holding each block."


def test_show_sharding_1d_and_replicated():
    mesh = kml.Mesh(data=2, model=4)
    lines = render(kml.show_sharding(mesh, (256,), ("model",)))
    assert cells(lines[3]) == ["[0:64]", "[64:128]", "[128:192]", "[192:256]"]
    assert cells(lines[5]) == ["0, 4", "1, 5", "2, 6", "3, 7"]
    lines = render(kml.show_sharding(mesh, (128, 256), (None, None)))
    assert lines[1] == "1 block of shape (128, 256), on all 8 devices: not split"
    assert cells(lines[5]) == ["[0:128, :]", "0-7"]


@pytest.mark.parametrize(
    "shape, axes, error, message",
    [
        (
            (64, 32),
            (None,),
            kml.RankMismatchError,
            "Layout (None,) has 1 entries but the shape (64, 32) has rank 2",
        ),
        ((64, 32), (None, "expert"), kml.InvalidRuleError, "names mesh axis 'expert', but the mesh has axes"),
        ((64, 32), ("model", "model"), kml.InvalidRuleError, "uses mesh axis 'model' twice"),
        ((64, 30), (None, "model"), kml.IndivisibleShapeError, "30 is not a multiple of 4"),
        ((64, 32), None, kml.InvalidOptionError, "pass axes, one mesh-axis name or None per dimension"),
    ],
    ids=["rank", "unknown-axis", "axis-twice", "indivisible", "no-axes"],
)
def test_show_sharding_errors(shape, axes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        kml.show_sharding(kml.Mesh(data=2, model=4), shape, axes)


def test_show_sharding_takes_the_layout_of_a_resolution():
    mesh = kml.Mesh(data=2, model=4)
    entry = kml.ModelParallel(mesh).resolve("d/kernel", (256, 128))
    with pytest.raises(kml.InvalidOptionError, match="pass axes only with a shape"):
        kml.show_sharding(mesh, entry, ("model", None))


# -- the plan as a PNG -----------------------------------------------------------------


@pytest.fixture(scope="module")
def plan() -> kml.Plan:
    mesh = kml.Mesh(data=2, model=4)
    return kml.dry_plan(build_encoder, kml.ModelParallel(mesh, kml.transformer_rules()), optimizer="adam")


def read_png(path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(path)


@pytest.mark.parametrize(
    "with_mesh, options",
    [(False, {}), (True, {"device_memory": "300KiB"}), (False, {"device_memory": "80GB", "top": 3})],
    ids=["plain", "mesh-and-capacity", "large-capacity"],
)
def test_plot_plan_writes_a_png(plan, tmp_path, with_mesh, options):
    if with_mesh:
        options = {**options, "mesh": kml.Mesh(data=2, model=4)}
    path = kml.plot_plan(plan, tmp_path / "plan.png", **options)
    assert path == tmp_path / "plan.png" and path.is_file()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = read_png(path)
    assert pixels.shape[:2] == (500, 1200)  # 12 × 5 inches at 100 dpi
    rgb = (pixels[..., :3] * 255).astype(np.uint32)
    colours = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])
    assert len(colours) > 50 and pixels.std() > 0.05  # drawn on, not blank


def test_plan_plot_is_plot_plan(plan, tmp_path):
    path = plan.plot(str(tmp_path / "plan.png"), top=4)
    assert path == tmp_path / "plan.png"
    assert kml.plot_plan(plan, tmp_path / "same.png", top=4).read_bytes() == path.read_bytes()


def test_plot_plan_on_a_3d_mesh(tmp_path):
    mesh = kml.Mesh(stage=2, data=2, model=2)
    dist = kml.ModelParallel(mesh, kml.transformer_rules(), batch_axis="data")
    path = kml.plot_plan(kml.dry_plan(build_encoder, dist, optimizer="sgd"), tmp_path / "plan.png", mesh=mesh)
    assert read_png(path).shape[:2] == (500, 1200)


def test_plot_plan_rejects_another_mesh(plan, tmp_path):
    with pytest.raises(kml.InvalidOptionError, match="plan was made on data=2 × model=4"):
        kml.plot_plan(plan, tmp_path / "plan.png", mesh=kml.Mesh(data=4, model=2))
    with pytest.raises(kml.InvalidOptionError, match="top must be a non-negative integer"):
        kml.plot_plan(plan, tmp_path / "plan.png", top=-1)


def test_plot_plan_without_matplotlib_says_how_to_install_it(plan, tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=r'pip install matplotlib .*pip install "\.\[plot\]"'):
        kml.plot_plan(plan, tmp_path / "plan.png")
    assert not (tmp_path / "plan.png").exists()
