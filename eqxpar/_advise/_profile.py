"""Device profiles: the rates a step-time prediction divides work by."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._errors import PlanError


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one accelerator and its links can do, for predicting a step's time.

    **Fields:**

    - `name`: a label for tables.
    - `flops_per_s`: dtype name (`"float32"`, `"bfloat16"`) -> dense matmul FLOP/s.
    - `hbm_bytes_per_s`: device memory bandwidth (a copy's bytes read + written / s).
    - `intra_node_bytes_per_s`: bytes per second one device sends to the others
      of its node (one direction).
    - `inter_node_bytes_per_s`: bytes per second one device sends across nodes.
    - `devices_per_node`: devices that share the fast intra-node links.
    - `memory_bytes`: device memory, the default budget of `eqxpar.advise`.

    Build your own for other hardware; `PROFILES` holds eqxpar's.

    ```python
    mine = eqxpar.DeviceProfile(
        name="my-gpu", flops_per_s={"float32": 100e12, "bfloat16": 400e12},
        hbm_bytes_per_s=2e12, intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9, devices_per_node=4, memory_bytes=48 * 2**30,
    )
    ```
    """

    name: str
    flops_per_s: Mapping[str, float]
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    devices_per_node: int
    memory_bytes: int

    def __post_init__(self):
        rates = dict(self.flops_per_s)
        if "float32" not in rates or any(not (r > 0) for r in rates.values()):
            raise PlanError(
                f"DeviceProfile(flops_per_s={rates!r}): expected positive FLOP/s per dtype name, "
                "including 'float32', e.g. {'float32': 100e12, 'bfloat16': 400e12}."
            )
        for what in ("hbm_bytes_per_s", "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, what) > 0:
                raise PlanError(f"DeviceProfile({what}={getattr(self, what)!r}): expected a positive rate.")
        if self.devices_per_node < 1 or self.memory_bytes < 1:
            raise PlanError(
                f"DeviceProfile(devices_per_node={self.devices_per_node!r}, memory_bytes="
                f"{self.memory_bytes!r}): expected positive integers."
            )
        # A plain dict, frozen by convention: the profile is a value.
        object.__setattr__(self, "flops_per_s", rates)

    def flops(self, dtype: Any) -> float:
        """Matmul FLOP/s for arrays of `dtype` (float32's rate for dtypes not listed)."""
        name = getattr(dtype, "name", str(dtype))
        return self.flops_per_s.get(name, self.flops_per_s["float32"])

    def link(self, group: int, stride: int) -> float:
        """Bytes per second per device of a collective over `group` devices whose
        neighbours are `stride` devices apart in the mesh's device order: within a
        node when the whole group fits inside one."""
        within = group * stride <= self.devices_per_node
        return self.intra_node_bytes_per_s if within else self.inter_node_bytes_per_s


#: eqxpar's profiles. "h100": an 8-GPU H100 SXM node. Matmul and copy rates are
#: measured on one H100 by `benchmarks.one_device` (benchmarks/results/
#: one_device_gpu.json: 682 TFLOP/s bf16, 358 f32, 2.54 TB/s copy); the links
#: cannot be measured here and come from NVIDIA's public specifications: NVLink 4
#: at 900 GB/s per GPU both directions (450 GB/s each way), and one 400 Gb/s
#: ConnectX-7 InfiniBand NIC per GPU (50 GB/s) across nodes; 80 GB HBM3.
#: "tpu_v5p": Google's public TPU v5p figures (459 TFLOP/s bf16, 2.765 TB/s HBM,
#: 95 GB HBM; ICI 4,800 Gb/s per chip, taken as 600 GB/s within a 4x4x4 cube of
#: 64 chips, float32 matmuls at a quarter of bf16); nothing measured here.
#: "cpu": this repository's simulated devices, measured on the 2-core CPU machine
#: (benchmarks/results/one_device_cpu.json: 0.29 TFLOP/s f32, 0.26 bf16, 8.3 GB/s
#: copy); the 8 devices share the host's memory, so a collective moves at the
#: copy rate; 8 GiB of memory per device.
PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile(
        name="h100",
        flops_per_s={"float32": 357.9e12, "bfloat16": 681.8e12, "float16": 681.8e12},
        hbm_bytes_per_s=2.540e12,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        devices_per_node=8,
        memory_bytes=80 * 10**9,
    ),
    "tpu_v5p": DeviceProfile(
        name="tpu_v5p",
        flops_per_s={"float32": 459e12 / 4, "bfloat16": 459e12},
        hbm_bytes_per_s=2.765e12,
        intra_node_bytes_per_s=600e9,
        inter_node_bytes_per_s=600e9 / 4,
        devices_per_node=64,
        memory_bytes=95 * 10**9,
    ),
    "cpu": DeviceProfile(
        name="cpu",
        flops_per_s={"float32": 0.2949e12, "bfloat16": 0.2556e12},
        hbm_bytes_per_s=8.347e9,
        intra_node_bytes_per_s=8.347e9,
        inter_node_bytes_per_s=8.347e9,
        devices_per_node=8,
        memory_bytes=8 * 2**30,
    ),
}


def as_profile(device: Any) -> DeviceProfile:
    """`device` (a `DeviceProfile` or a name in `PROFILES`) as a profile."""
    if isinstance(device, DeviceProfile):
        return device
    if isinstance(device, str) and device in PROFILES:
        return PROFILES[device]
    raise PlanError(
        f"advise(device={device!r}): expected a DeviceProfile or one of {sorted(PROFILES)}. "
        "Build an eqxpar.DeviceProfile for other hardware."
    )
